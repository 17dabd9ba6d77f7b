"""CUDA graphs for the decode step, one per (batch-size bucket, page-table-width bucket).

A batch of `bs` requests with tables `width` pages wide runs in the graph of the smallest bucket
(B >= bs, P >= width). The extra rows are dummy requests: token 0 at position 0 with all-zero page
tables, so they write to and read from the reserved dummy page 0 only. Width buckets are powers
of two up to `max_pages`; graphs are captured lazily on first use and share one memory pool.
Batches above the largest size bucket or wider than `max_pages` run eager (the runner decides
with `can_run`). `destroy()` drops every graph and its memory pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B] i64
    positions: torch.Tensor  # [B] i64
    full_t: torch.Tensor  # [B, P] i64
    swa_t: torch.Tensor  # [B, P] i64
    out: torch.Tensor  # [B, V] f32


def graph_bucket(batch_sizes: list[int], max_pages: int, bs: int, width: int) -> tuple[int, int]:
    """(smallest size bucket >= bs, smallest power of two >= width capped at max_pages).

    Valid only when bs <= max(batch_sizes) and width <= max_pages (see `can_run`).
    """
    size = next(b for b in sorted(batch_sizes) if b >= bs)
    pages = 1
    while pages < width:
        pages *= 2
    return size, min(pages, max_pages)


class CudaGraphDecoder:
    """Captures and replays `step(tokens, positions, full_t, swa_t) -> logits`."""

    def __init__(self, step: StepFn, device: torch.device, batch_sizes: list[int],
                 max_pages: int) -> None:
        self.step = step
        self.device = device
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_pages = max_pages
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def can_run(self, bs: int, width: int) -> bool:
        return bs <= self.batch_sizes[-1] and width <= self.max_pages

    def bucket(self, bs: int, width: int) -> tuple[int, int]:
        return graph_bucket(self.batch_sizes, self.max_pages, bs, width)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, full_t: torch.Tensor,
            swa_t: torch.Tensor) -> torch.Tensor:
        """Copy the batch into the bucket's static buffers, replay, return logits [bs, V]."""
        bs, width = full_t.shape
        key = self.bucket(bs, width)
        g = self.graphs.get(key) or self._capture(*key)
        g.tokens.zero_()
        g.positions.zero_()
        g.full_t.zero_()
        g.swa_t.zero_()
        g.tokens[:bs].copy_(tokens)
        g.positions[:bs].copy_(positions)
        g.full_t[:bs, :width].copy_(full_t)
        g.swa_t[:bs, :width].copy_(swa_t)
        g.graph.replay()
        return g.out[:bs].clone()  # [bs, V]; the static buffer is reused by the next replay

    def capture_all(self, widths: list[int]) -> None:
        """Capture every (size bucket, width) now instead of on first use (warm-up)."""
        for size in self.batch_sizes:
            for width in widths:
                key = self.bucket(size, width)
                if key not in self.graphs:
                    self._capture(*key)

    def _capture(self, size: int, pages: int) -> _Graph:
        dev = self.device
        tokens = torch.zeros(size, dtype=torch.long, device=dev)  # [B]
        positions = torch.zeros(size, dtype=torch.long, device=dev)  # [B]
        full_t = torch.zeros(size, pages, dtype=torch.long, device=dev)  # [B, P]
        swa_t = torch.zeros(size, pages, dtype=torch.long, device=dev)  # [B, P]
        stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy inits and allocator state outside the graph
                self.step(tokens, positions, full_t, swa_t)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.step(tokens, positions, full_t, swa_t)  # [B, V]
        torch.cuda.synchronize(dev)
        g = _Graph(graph, tokens, positions, full_t, swa_t, out)
        self.graphs[(size, pages)] = g
        log.info("captured decode graph: batch %d, %d pages", size, pages)
        return g

    def destroy(self) -> None:
        """Drop every graph and static buffer; frees the graph memory pool."""
        for g in self.graphs.values():
            g.graph.reset()
        self.graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
