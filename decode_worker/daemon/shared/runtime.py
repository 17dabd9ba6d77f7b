"""Build what a worker runs on from settings: the model, its pools, and the model facts.

Shared by the decode worker and the prefill peer so both sides size and describe their pools
the same way (the handshake compares what `model_compat` returns).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_worker.core.memory_budget import MemoryBudget, MemoryBudgetError, gib
from decode_worker.core.validation import (
    CacheCombo,
    ModelFacts,
    model_facts_from_hf_config,
    validate_startup,
)
from decode_worker.daemon.shared.host_plan import HostPlan, check_host_size, plan_host_tier
from decode_worker.daemon.shared.landing_plan import (
    allocate_landing,
    budget_less_landing,
    landing_pages,
)
from decode_worker.device.attention_backend import AttentionBackend, resolve_attention_backend
from decode_worker.device.default_model import ensure_default_model
from decode_worker.device.gpu_memory import CudaMemory, DeviceMemory, ShareTracker
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.landing import LandingArea
from decode_worker.device.layout import CacheLayout, plan_cache_layout
from decode_worker.device.memory_probe import (
    PROBE_PREFILL_TOKENS,
    capture_probe,
    eager_probe,
    probe_pools,
)
from decode_worker.device.model.base import CausalLM
from decode_worker.device.model.registry import load_model, read_json, read_model_config
from decode_worker.device.model.weights import resolve_moe_backend
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
    host_plan: HostPlan | None = None  # the host tier's size (decode, host tier on)
    landing: LandingArea | None = None  # for SGLang prefills of an all-layer model (decode)

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
    """The facts start-up validation checks, from the family's reading of config.json (its
    layer types and window, whichever form the config states them in). Raises ConfigError
    for an unsupported architecture or a missing or invalid field."""
    raw = read_json(model_dir / "config.json")
    _, cfg = read_model_config(model_dir)
    return model_facts_from_hf_config({**raw, "layer_types": list(cfg.layer_types),
                                       "sliding_window": cfg.sliding_window})


def build_runtime(settings: Settings, *, use_cuda_graph: bool,
                  host_tier: bool = False, landing: bool = False) -> Runtime:
    """Validate the model/cache combination, then load the model and allocate the pools, and
    with `host_tier` size the host tier (an explicit `cache.hicache_size_gb` is checked against
    the host's available memory before the model loads); with `landing` (a decode worker) the
    landing area SGLang prefills of an all-layer model need (`landing_pages`), whose bytes come
    out of a derived pool budget.

    On CUDA the pools get this process's share of the device (`cache.memory_fraction` of its
    total memory) less the weights, the measured graph memory and activation headroom
    (`device/gpu_memory.py`).
    Raises ConfigError (with the fix) for an unsupported combination, a missing model, a
    device without room for the share, or pools that do not fit.
    """
    model_dir = resolve_model_dir(settings)
    facts = read_model_facts(model_dir)
    c = settings.cache
    validate_startup(facts, CacheCombo(
        page_size=c.page_size, decode_radix_cache=c.decode_radix_cache,
        unified_radix_tree=c.unified_radix_tree, hierarchical_cache=c.hierarchical_cache,
        num_full_pages=c.num_full_pages, num_swa_pages=c.num_swa_pages))
    if host_tier:
        check_host_size(c)
    device, dtype, kv_dtype = _device_and_dtypes(settings)
    attention = resolve_attention_backend(settings.model.attention_backend, device)
    moe = resolve_moe_backend(settings.model.moe_backend, device)
    explicit = c.num_full_pages is not None and c.num_swa_pages is not None
    memory = CudaMemory(device) if device.type == "cuda" else None
    share = None
    if memory is not None and not explicit:
        share = ShareTracker.start(memory, c.memory_fraction)
    model = load_model(model_dir, device, dtype, moe_backend=moe)
    spec = KVSpec.from_config(model.cfg)
    graphs = use_cuda_graph and settings.scheduler.cuda_graph and device.type == "cuda"
    pool_budget = None
    if share is not None:
        pool_budget = _measure_share(share, settings, model, spec, kv_dtype, graphs,
                                     attention).pool_bytes
        share.mem.release_cached()  # the probe pools and runners are gone
    num_landing = landing_pages(settings, model.cfg.sglang_ordinary) if landing else 0
    pool_budget = budget_less_landing(pool_budget, num_landing, settings, spec, device,
                                      kv_dtype)
    layout = plan_cache_layout(c, spec, device, kv_dtype, budget_bytes=pool_budget)
    pools = _allocate_pools(layout, spec, device, kv_dtype, memory)
    area = allocate_landing(pools, num_landing, memory, model.cfg.model_type)
    runner = _make_runner(settings, model, use_cuda_graph, attention)(pools)
    graph_bytes = _capture(runner, settings, memory)
    if share is not None:
        share.check_graphs(graph_bytes)
    host_plan = (plan_host_tier(c, pools.page_bytes("full") * spec.num_full_layers,
                                layout.num_full_pages, layout.page_size) if host_tier else None)
    log.info("%s", describe_budget(share, model, layout, spec, graph_bytes, host_plan))
    log.info("runtime: %s on %s (%s, %s decode attention, %s MoE), pools %d full / %d swa "
             "pages of %d tokens (%s)", model_dir, device, dtype, attention, moe,
             layout.num_full_pages, layout.num_swa_pages, layout.page_size, layout.source)
    return Runtime(runner, Tokenizer.from_dir(model_dir), model_dir,
                   settings.model.served_model_name or model_dir.name, facts, layout, host_plan,
                   area)


def _device_and_dtypes(settings: Settings) -> tuple[torch.device, torch.dtype, torch.dtype]:
    ms = settings.model
    want_cuda = ms.device == "cuda" or (ms.device == "auto" and torch.cuda.is_available())
    if ms.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device='cuda': no CUDA device is visible; use 'auto' or 'cpu'")
    dtype = _DTYPES.get(ms.dtype, torch.bfloat16 if want_cuda else torch.float32)
    return torch.device("cuda" if want_cuda else "cpu"), dtype, _DTYPES.get(
        settings.cache.kv_dtype, dtype)


def _make_runner(settings: Settings, model: CausalLM, use_cuda_graph: bool,
                 attention: AttentionBackend) -> Callable[[KVPools], ModelRunner]:
    """Runners over given pools (the real ones, the probes'), all with the resolved backend."""
    sched = settings.scheduler
    lookahead = settings.speculative.lookahead  # a verify step writes this far ahead

    def make(pools: KVPools) -> ModelRunner:
        return ModelRunner(model, pools, use_cuda_graph=use_cuda_graph and sched.cuda_graph,
                           graph_batch_sizes=sched.cuda_graph_batch_sizes,
                           attention_backend=attention, lookahead=lookahead)

    return make


def _measure_share(share: ShareTracker, settings: Settings, model: CausalLM, spec: KVSpec,
                   kv_dtype: torch.dtype, graphs: bool,
                   attention: AttentionBackend) -> MemoryBudget:
    """Weights, then the graphs and the headroom measured over probe pools (freed after)."""
    share.weights_loaded()
    sched, ps = settings.scheduler, settings.cache.page_size
    pools = probe_pools(spec, ps, model.cfg.max_position_embeddings, model.device, kv_dtype)
    if graphs and sched.cuda_graph_capture_tokens:
        share.measure_graphs(capture_probe(_make_runner(settings, model, True, attention),
                                           pools, sched.cuda_graph_capture_tokens,
                                           verify_group_lens(settings)))
    eager = _make_runner(settings, model, False, attention)(pools)
    # a prefill peer decodes nothing; a verify step runs 1 + K entries per request
    rows = sched.max_running_requests * (1 + settings.speculative.lookahead) if graphs else 1
    share.measure_headroom(lambda: eager_probe(eager, rows, PROBE_PREFILL_TOKENS))
    return share.budget()


def _allocate_pools(layout: CacheLayout, spec: KVSpec, device: torch.device,
                    kv_dtype: torch.dtype, memory: DeviceMemory | None) -> KVPools:
    """The pools, or a ConfigError naming the numbers when the device has no room for them
    (explicit `cache.num_*_pages`, or other processes took memory since the start)."""
    need = sum(layout.pool_bytes(spec))
    if memory is not None:
        free, _ = memory.mem_get_info()
        if need > free:
            raise MemoryBudgetError(
                f"KV pools of {layout.num_full_pages} full / {layout.num_swa_pages} SWA pages "
                f"need {gib(need)}, the device has {gib(free)} free; lower cache.num_*_pages "
                "or cache.memory_fraction")
    return KVPools(spec, layout.num_full_pages, layout.num_swa_pages, layout.page_size,
                   device, kv_dtype)


def verify_group_lens(settings: Settings) -> tuple[int, ...]:
    """The entries a request may have in a verify step (2 .. 1 + K; none without
    speculation): the grouped graphs to capture at start-up."""
    return tuple(range(2, settings.speculative.lookahead + 2))


def _capture(runner: ModelRunner, settings: Settings, memory: DeviceMemory | None) -> int:
    """Capture the start-up graphs (if any); the bytes they took (0 without a device)."""
    tokens = settings.scheduler.cuda_graph_capture_tokens
    if runner.graphs is None or not tokens:
        return 0
    before = memory.held_bytes() if memory is not None else 0
    t0 = time.perf_counter()
    count = runner.capture_graphs(tokens, verify_group_lens(settings))
    took = (memory.held_bytes() - before) if memory is not None else 0
    verify = len(runner.graphs.grouped) if runner.graphs is not None else 0
    log.info("captured %d decode graphs (%d of them for verify steps; contexts up to %d "
             "tokens) in %.1f s, %s", count, verify, tokens, time.perf_counter() - t0,
             gib(took))
    return took


def describe_budget(share: ShareTracker | None, model: CausalLM, layout: CacheLayout,
                    spec: KVSpec, graph_bytes: int, host: HostPlan | None = None) -> str:
    """The start-up budget line: the share's figures on CUDA (the pools as allocated), the
    weights and pools on CPU (`cache.cpu_pool_bytes`) or with explicit `cache.num_*_pages`;
    then the host tier when there is one (host memory, outside the device share)."""
    pools = sum(layout.pool_bytes(spec))
    if share is not None:
        b = share.budget()
        line = MemoryBudget(b.fraction, b.total_bytes, b.weights_bytes, graph_bytes,
                            b.headroom_bytes, pools).describe()
    else:
        where = "cache.cpu_pool_bytes" if model.device.type == "cpu" else "cache.num_*_pages"
        line = (f"memory budget ({model.device.type}): weights {gib(model.weights_bytes())}, "
                f"pools {gib(pools)} ({where}), graphs {gib(graph_bytes)}, headroom not reserved")
    return line if host is None else f"{line}; {host.describe()}"
