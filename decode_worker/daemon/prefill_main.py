"""`decode-worker prefill`: run the reference prefill peer until SIGTERM/SIGINT.

Loads the model (the embedded tiny gpt-oss when `model.path` is unset), builds its own pools
(sized by the `cache` settings, no CUDA graphs, no radix cache) and serves the ZMQ bootstrap
port. Prompts come in the decode side's transfer requests (`prompt_ids`) or, once the HTTP
layer is wired, from `POST /generate` with `bootstrap_room`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import torch

from decode_worker.daemon.prefill_peer import PrefillPeer
from decode_worker.device.default_model import ensure_default_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.layout import plan_cache_layout
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.settings import LoadedSettings, Settings

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_runner(settings: Settings) -> tuple[ModelRunner, str]:
    """Load the model and size pools for it; returns the runner and the model's name.

    Raises ConfigError for a missing/broken model or pools that do not fit.
    """
    ms = settings.model
    model_dir = Path(ms.path) if ms.path else ensure_default_model(ms.cache_dir, ms.seed)
    want_cuda = ms.device == "cuda" or (ms.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if want_cuda else "cpu")
    auto = torch.bfloat16 if want_cuda else torch.float32
    dtype = _DTYPES.get(ms.dtype, auto)
    kv_dtype = _DTYPES.get(settings.cache.kv_dtype, dtype)
    model = load_model(model_dir, device, dtype)
    spec = KVSpec.from_config(model.cfg)
    layout = plan_cache_layout(settings.cache, spec, device, kv_dtype)
    pools = KVPools(spec, layout.num_full_pages, layout.num_swa_pages, layout.page_size,
                    device, kv_dtype)  # fmt: skip
    runner = ModelRunner(model, pools, use_cuda_graph=False, graph_batch_sizes=[1])
    return runner, ms.served_model_name or model_dir.name


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    settings = loaded.settings
    runner, name = build_runner(settings)
    peer = PrefillPeer(runner, settings.transfer, name,
                       match_timeout_s=settings.scheduler.kv_timeout_s)  # fmt: skip
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        log.info("prefill peer: signal %d, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    t = settings.transfer
    log.info("prefill peer %s serving %s on %s:%d (page %d, %d full / %d swa pages)",
             peer.agent.name, name, t.bootstrap_host, t.bootstrap_port, runner.pools.page_size,
             runner.pools.num_pages["full"], runner.pools.num_pages["swa"])  # fmt: skip
    print(f"prefill peer ready on {t.bootstrap_host}:{t.bootstrap_port}", flush=True)
    while not stop.wait(0.5):
        pass
    peer.close()
    runner.destroy()
    return 0
