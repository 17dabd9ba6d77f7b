"""Build what a worker runs on from settings: the model, its pools, and the model facts.

Shared by the decode worker and the prefill peer so both sides size and describe their pools
the same way (the handshake compares what `model_compat` returns).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_worker.core.validation import (
    CacheCombo,
    ModelFacts,
    model_facts_from_hf_config,
    validate_startup,
)
from decode_worker.device.attention_backend import resolve_attention_backend
from decode_worker.device.default_model import ensure_default_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.layout import CacheLayout, plan_cache_layout
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.errors import ConfigError
from decode_worker.settings import Settings

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class Runtime:
    """A loaded model over its pools (runtime facts, never written back into settings)."""

    runner: ModelRunner
    tokenizer: Tokenizer
    model_dir: Path
    model_name: str
    facts: ModelFacts
    layout: CacheLayout

    @property
    def pools(self) -> KVPools:
        return self.runner.pools


def resolve_model_dir(settings: Settings) -> Path:
    """`model.path`, or the embedded default model (written once under `model.cache_dir`)."""
    ms = settings.model
    if ms.path is None:
        return ensure_default_model(ms.cache_dir, ms.seed)
    path = Path(ms.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path={str(path)!r}: no config.json there (a local Hugging Face "
                          "model directory is expected)")
    return path


def read_model_facts(model_dir: Path) -> ModelFacts:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model config {model_dir / 'config.json'}: {exc}") from None
    return model_facts_from_hf_config(config)


def build_runtime(settings: Settings, *, use_cuda_graph: bool) -> Runtime:
    """Validate the model/cache combination, then load the model and allocate the pools.

    Raises ConfigError (with the fix) for an unsupported combination, a missing model or pools
    that do not fit.
    """
    model_dir = resolve_model_dir(settings)
    facts = read_model_facts(model_dir)
    c = settings.cache
    validate_startup(facts, CacheCombo(
        page_size=c.page_size, decode_radix_cache=c.decode_radix_cache,
        unified_radix_tree=c.unified_radix_tree, hierarchical_cache=c.hierarchical_cache,
        num_full_pages=c.num_full_pages, num_swa_pages=c.num_swa_pages))
    ms = settings.model
    want_cuda = ms.device == "cuda" or (ms.device == "auto" and torch.cuda.is_available())
    if ms.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device='cuda': no CUDA device is visible; use 'auto' or 'cpu'")
    device = torch.device("cuda" if want_cuda else "cpu")
    attention = resolve_attention_backend(ms.attention_backend, device)
    dtype = _DTYPES.get(ms.dtype, torch.bfloat16 if want_cuda else torch.float32)
    kv_dtype = _DTYPES.get(c.kv_dtype, dtype)
    model = load_model(model_dir, device, dtype)
    spec = KVSpec.from_config(model.cfg)
    layout = plan_cache_layout(c, spec, device, kv_dtype)
    pools = KVPools(spec, layout.num_full_pages, layout.num_swa_pages, layout.page_size,
                    device, kv_dtype)
    sched = settings.scheduler
    runner = ModelRunner(model, pools, use_cuda_graph=use_cuda_graph and sched.cuda_graph,
                         graph_batch_sizes=sched.cuda_graph_batch_sizes,
                         attention_backend=attention)
    if runner.graphs is not None and sched.cuda_graph_capture_tokens:
        t0 = time.perf_counter()
        count = runner.capture_graphs(sched.cuda_graph_capture_tokens)
        log.info("captured %d decode graphs (contexts up to %d tokens) in %.1f s", count,
                 sched.cuda_graph_capture_tokens, time.perf_counter() - t0)
    log.info("runtime: %s on %s (%s, %s decode attention), pools %d full / %d swa pages of "
             "%d tokens (%s)", model_dir, device, dtype, attention, layout.num_full_pages,
             layout.num_swa_pages, layout.page_size, layout.source)
    return Runtime(runner, Tokenizer.from_dir(model_dir), model_dir,
                   ms.served_model_name or model_dir.name, facts, layout)
