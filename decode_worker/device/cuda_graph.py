"""Graphs for the decode step, one per (batch-size bucket, page-table-width bucket).

A batch of `bs` requests with tables `width` pages wide runs in the graph of the smallest bucket
(B >= bs, P >= width). The extra rows are dummy requests: token 0 at position 0 with all-zero page
tables, so they write to and read from the reserved dummy page 0 only. Width buckets are powers
of two up to `max_pages`; a step that reads each request's keys whatever the width (the Triton
attention) has one graph per size bucket, P = `max_pages` (`width_buckets=False`). Graphs are
captured on first use or ahead of time (`capture_all`, at start-up) and share one memory pool.
Batches above the largest size bucket or wider than `max_pages` run eager (the runner decides
with `can_run`). `destroy()` drops every graph and its memory pool.

Capturing is split from the bucket logic: `CudaGraphBackend` captures real CUDA graphs;
`FakeGraphBackend` (CPU, for tests) "replays" by re-running the step into the same static
buffers, so the buckets, padding and static-buffer handling run on machines without a GPU.
Before any capture the step runs once under `CaptureGuard`, which names every op that cannot
live in a CUDA graph (host syncs, data-dependent shapes, host tensors, other devices).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from decode_worker.errors import ConfigError

log = logging.getLogger(__name__)

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Replay = Callable[[], object]

# ops that read a tensor back to the host or whose output shape depends on tensor values: a
# CUDA graph cannot contain them (they fail capture, or freeze one step's value into the graph)
_UNCAPTURABLE = frozenset({
    "aten::_local_scalar_dense",  # .item(), int(t), bool(t)
    "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::bincount", "aten::histc",
    "aten::lift_fresh",  # torch.tensor(data) inside the step: a host copy frozen into the graph
})
_INDEX_OPS = frozenset({
    "aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
})


class GraphCaptureError(ConfigError):
    """The decode step contains ops that a CUDA graph cannot hold."""


class CaptureGuard(TorchDispatchMode):
    """Records every op of the guarded code that cannot run inside a CUDA graph on `device`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.problems: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func._schema.name  # e.g. "aten::nonzero"
        if name in _UNCAPTURABLE:
            self.problems.append(name)
        elif name in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                        for i in args[1]):
            self.problems.append(f"{name} with a boolean mask")  # runs nonzero inside
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != self.device.type:
                self.problems.append(f"{name} -> a tensor on {t.device}")
        return out


def check_capturable(fn: Callable[[], object], device: torch.device) -> None:
    """Run `fn` once under `CaptureGuard`; raise GraphCaptureError naming what it found."""
    with CaptureGuard(device) as guard:
        fn()
    if guard.problems:
        found = ", ".join(sorted(set(guard.problems)))
        raise GraphCaptureError(f"the decode step cannot be captured in a CUDA graph ({found}); "
                                "set scheduler.cuda_graph = false to run it eager")


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Capture `fn` (whose inputs are static buffers): (replay, static output)."""
        ...

    def release(self) -> None:
        """Free every capture's memory (the graphs are no longer replayed)."""
        ...


class CudaGraphBackend:
    """Real CUDA graphs sharing one memory pool (replays never overlap; only the static
    inputs and outputs, which stay referenced, carry data between replays)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        dev = self.device
        stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy inits and allocator state outside the graph
                fn()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        torch.cuda.synchronize(dev)
        self.graphs.append(graph)
        return graph.replay, out

    def release(self) -> None:
        for g in self.graphs:
            g.reset()
        self.graphs.clear()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(slots=True)
class FakeGraphBackend:
    """CPU stand-in for tests: a 'replay' re-runs the step and writes into the same static
    output, so everything around the capture (buckets, padding, static buffers) is exercised."""

    captured: int = 0
    released: bool = field(default=False)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        out = fn()
        self.captured += 1
        return (lambda: out.copy_(fn())), out

    def release(self) -> None:
        self.released = True


@dataclass(slots=True)
class _Graph:
    replay: Replay
    tokens: torch.Tensor  # [B] i64
    positions: torch.Tensor  # [B] i64
    full_t: torch.Tensor  # [B, P] i32 (the row tables' dtype)
    swa_t: torch.Tensor  # [B, ring] i32
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


def capture_widths(pages: int, max_pages: int) -> list[int]:
    """Widths whose buckets cover tables up to `pages` wide: powers of two, then the bound."""
    top, widths, w = min(pages, max_pages), [], 1
    while w < top:
        widths.append(w)
        w *= 2
    return [*widths, top]


class CudaGraphDecoder:
    """Captures and replays `step(tokens, positions, full_t, swa_t) -> logits`."""

    def __init__(self, step: StepFn, device: torch.device, batch_sizes: list[int],
                 max_pages: int, backend: GraphBackend | None = None, *,
                 swa_ring: int, width_buckets: bool = True) -> None:
        """`swa_ring`: columns of every graph's SWA table (a ring sized to the window, see
        `device/decode_inputs.py`). `width_buckets=False`: `step` reads each request's keys
        whatever the table width, so every graph has the `max_pages`-wide table."""
        self.step = step
        self.device = device
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_pages = max_pages
        self.swa_ring = swa_ring
        self.backend = backend if backend is not None else CudaGraphBackend(device)
        self.width_buckets = width_buckets
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def can_run(self, bs: int, width: int) -> bool:
        return bs <= self.batch_sizes[-1] and width <= self.max_pages

    def bucket(self, bs: int, width: int) -> tuple[int, int]:
        size, pages = graph_bucket(self.batch_sizes, self.max_pages, bs, width)
        return size, pages if self.width_buckets else self.max_pages

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, full_t: torch.Tensor,
            swa_t: torch.Tensor) -> torch.Tensor:
        """Copy the batch into the bucket's static buffers, replay, return logits [bs, V].

        The logits are a view of the graph's static output, valid until the next `run`
        (sample them first, or clone). swa_t: [bs, swa_ring]."""
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
        g.swa_t[:bs].copy_(swa_t)
        g.replay()
        return g.out[:bs]  # [bs, V]; a view: the next replay overwrites it

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
        full_t = torch.zeros(size, pages, dtype=torch.int32, device=dev)  # [B, P]
        swa_t = torch.zeros(size, self.swa_ring, dtype=torch.int32, device=dev)  # [B, ring]

        def step() -> torch.Tensor:
            return self.step(tokens, positions, full_t, swa_t)  # [B, V]

        check_capturable(step, dev)
        replay, out = self.backend.capture(step)
        g = _Graph(replay, tokens, positions, full_t, swa_t, out)
        self.graphs[(size, pages)] = g
        log.debug("captured decode graph: batch %d, %d pages", size, pages)
        return g

    def destroy(self) -> None:
        """Drop every graph and static buffer; frees the graph memory pool."""
        self.graphs.clear()
        self.backend.release()
