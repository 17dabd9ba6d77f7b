"""Probe workloads that measure what a process needs beside its pools (CUDA start-up).

- `capture_probe`: every CUDA graph the start-up captures, over probe pools as wide as the
  graphs' tables but otherwise tiny; the graph memory pool is what the real capture will take.
- `eager_probe`: the largest eager work a process runs outside graphs: a decode step of
  `max_running_requests` rows over the widest table, the sampler's sort of its logits, and a
  prefill of `min(context, PROBE_PREFILL_TOKENS)` tokens. Its peak is the activation headroom.
Every probe reads and writes page 0 (the dummy page) only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.runner import ModelRunner
from decode_worker.utils.mathx import cdiv

PROBE_PREFILL_TOKENS = 8192  # longer prefills (local recompute, the reference peer) may need more

RunnerFactory = Callable[[KVPools], ModelRunner]


def probe_pools(spec: KVSpec, page_size: int, table_tokens: int, device: torch.device,
                dtype: torch.dtype) -> KVPools:
    """Pools whose full pool is as wide as a table of `table_tokens` (the runner sizes its
    graphs' tables by it) and whose SWA pool is one page."""
    return KVPools(spec, max(1, cdiv(table_tokens, page_size)), 1, page_size, device, dtype)


def capture_probe(make_runner: RunnerFactory, pools: KVPools, capture_tokens: int,
                  group_lens: tuple[int, ...] = ()) -> Callable[[], Callable[[], None]]:
    """For `ShareTracker.measure_graphs`: capture every start-up graph over `pools` (with
    `group_lens`, the verify graphs too: `ModelRunner.capture_graphs`), return what frees the
    graphs and lets the pools go."""

    def capture() -> Callable[[], None]:
        runner = make_runner(pools)
        runner.capture_graphs(capture_tokens, group_lens)

        def release() -> None:
            runner.destroy()

        return release

    return capture


@torch.inference_mode()
def eager_probe(runner: ModelRunner, num_rows: int, prefill_tokens: int) -> None:
    """For `ShareTracker.measure_headroom` (see the module doc). `runner` runs over probe
    pools; its graphs, if any, are not used."""
    ps, dev = runner.pools.page_size, runner.device
    width = runner.max_pages
    tokens = torch.zeros(num_rows, dtype=torch.long, device=dev)  # [bs]
    positions = torch.full((num_rows,), width * ps - 1, dtype=torch.long, device=dev)  # [bs]
    full_t = torch.zeros(num_rows, width, dtype=torch.long, device=dev)  # [bs, width]
    swa_t = torch.zeros(num_rows, runner.swa_ring, dtype=torch.long, device=dev)  # [bs, ring]
    logits = runner.eager_step(tokens, positions, full_t, swa_t)  # [bs, V] f32
    torch.sort(logits, dim=-1, descending=True)  # the sampler's top-p / top-k sort
    del logits
    n = max(1, min(prefill_tokens, runner.model.cfg.max_position_embeddings - 1))
    pages = [0] * cdiv(n, ps)
    runner.prefill([0] * n, pages, pages)

