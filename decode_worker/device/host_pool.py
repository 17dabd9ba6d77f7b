"""The host tier's memory: full-attention KV pages in host RAM (pinned on CUDA), and the copies
device -> host (write) and host -> device (restore).

The host pool is page first, `pages: [num_host_pages + 1, num_full_layers, 2, page_size,
kv_heads, head_dim]` (page 0 unused): one host page, every full layer, is one contiguous block,
so a run of host pages that steps by one (the host allocator hands them out so) is one
contiguous block too. `host` is the same memory seen layer first, like the device full pool.
Every copy is planned the same way on both devices: split the host page ids into such runs
(`host_runs`), move each run as one block, and scatter or gather the device side with one
indexed copy (the device pages come from a LIFO allocator, rarely in runs):

- CPU: numpy views whose items are one (layer, page) row of the device pool; a restore
  assigns each host run straight into the device rows it belongs to, a write gathers the rows
  of each run into its host block: no Python work per layer, no temporary for a restore.
- CUDA, each direction on its own stream: a restore copies each host run into one device
  staging tensor (one DMA per run from pinned memory, no host-side gather) and scatters it into
  the device pages with one `index_copy_`; a write gathers the device pages with one
  `index_select` and copies each run into its host block (one DMA per run); both stage at
  most `STAGING_BYTES` of pages on the device at a time. The host thread never waits: a
  restore waits on the GPU for the compute stream (its fresh pages may still be read by a
  queued step) and for the writes (a host page it reads may still be on its way); the compute
  stream waits for a write before it reuses pages, never for a restore (a host page a restore
  reads stays locked until the restore is done, so no write reuses it). A restore records an
  event the caller polls. A write records one too (`WritesInFlight`): a NIXL transfer, which
  no stream orders, must not land in device pages a write still reads, so before one is
  posted `sync_writes_reading` blocks on the writes that read those pages, and on nothing
  when none does (the usual case: write-through reads pages the tree keeps);
  `sync_writes` blocks until every write is in host memory.

`fail_restores` is the fault point for tests: the next that many restores raise
`RestoreFailed` (nothing is copied).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from decode_worker.core.host_tier import HostRestore, HostWrite
from decode_worker.device.kv_pool import KVPools
from decode_worker.errors import TransferError

Runs = list[tuple[int, int, int]]
STAGING_BYTES = 64 << 20  # device memory one CUDA copy stages at most


class RestoreFailed(TransferError):
    """A host -> device restore could not be made (the request that needed it is aborted)."""


@dataclass(slots=True)
class RestoreHandle:
    """One restore in flight: `is_done()` polls it without blocking (always true on CPU, where
    the copy is made before `restore` returns); `wait()` blocks until it is done."""

    num_pages: int
    num_bytes: int
    started_s: float
    event: torch.cuda.Event | None = None

    def is_done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class WritesInFlight:
    """The device pages each write still in flight reads, in stream order, with the event its
    copy recorded; `wait_for(pages)` blocks only on the writes that read one of `pages`."""

    def __init__(self) -> None:
        self._writes: deque[tuple[_Event, frozenset[int]]] = deque()

    def __len__(self) -> int:
        return len(self._writes)

    def add(self, event: _Event, device_page_ids: Collection[int]) -> None:
        self._writes.append((event, frozenset(device_page_ids)))

    def reap(self) -> None:
        """Forget the writes that are done (oldest first: they complete in stream order)."""
        while self._writes and self._writes[0][0].query():
            self._writes.popleft()

    def wait_for(self, device_page_ids: Collection[int]) -> bool:
        """Block until no write in flight reads any of `device_page_ids`; True when it had to
        wait. One stream runs the writes in order, so waiting on the newest such write waits
        on every older one too."""
        self.reap()
        last = -1
        for i, (_, pages) in enumerate(self._writes):
            if not pages.isdisjoint(device_page_ids):
                last = i
        if last < 0:
            return False
        self._writes[last][0].synchronize()
        for _ in range(last + 1):
            self._writes.popleft()
        return True

    def wait_all(self) -> None:
        if self._writes:
            self._writes[-1][0].synchronize()
        self._writes.clear()


class HostKVPool:
    """Host pages of full-attention KV; the compute thread owns it."""

    def __init__(self, pools: KVPools, num_pages: int) -> None:
        self.pools = pools
        dev = pools.full  # [L, device pages + 1, 2, ps, H, D]
        self.num_pages = num_pages
        self.is_cuda = dev.is_cuda
        shape = (num_pages + 1, dev.shape[0], *dev.shape[2:])
        # pages: [num_host_pages + 1, num_full_layers, 2, page_size, kv_heads, head_dim]
        self.pages = torch.zeros(shape, dtype=dev.dtype, pin_memory=self.is_cuda)
        self.host = self.pages.transpose(0, 1)  # [L, num_host_pages + 1, 2, ps, H, D] view
        self.page_bytes = dev[:, 0].numel() * dev.element_size()  # all full layers of one page
        # CUDA: pages staged on the device at a time by one copy (bounded transient memory)
        self.chunk_pages = max(1, STAGING_BYTES // self.page_bytes)
        self.fail_restores = 0
        self.written_bytes_total = 0
        self._write_stream = torch.cuda.Stream(dev.device) if self.is_cuda else None
        self._restore_stream = torch.cuda.Stream(dev.device) if self.is_cuda else None
        self._writes = WritesInFlight()  # CUDA only: a CPU write is done when `write` returns
        self.write_waits_total = 0  # times a transfer had to wait for a write (CUDA)
        if not self.is_cuda:
            item = np.dtype((np.void, dev[0, 0].numel() * dev.element_size()))
            # (layer, page) rows as single numpy items, views of the pools' memory:
            # device rows: [L * (device pages + 1)], row l * (device pages + 1) + page
            self._dev_rows = dev.view(-1).view(torch.uint8).numpy().view(item)
            # host rows: [host pages + 1, L], one host page's rows contiguous
            self._host_rows = (self.pages.view(-1).view(torch.uint8).numpy().view(item)
                               .reshape(shape[:2]))
            # the device rows of each page, every layer: [device pages + 1, L] intp
            self._page_rows = np.arange(self._dev_rows.size, dtype=np.intp).reshape(
                dev.shape[0], dev.shape[1]).T.copy()

    def total_bytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()

    def write(self, job: HostWrite) -> None:
        """Copy device pages to host pages (the tree's `write_sink`)."""
        self.written_bytes_total += len(job.host_page_ids) * self.page_bytes
        runs = host_runs(job.host_page_ids)
        stream = self._write_stream
        if stream is None:
            rows = self._device_rows(job.device_page_ids)  # [n, L]
            for a, b, h in runs:  # host block [b - a, L] <- device rows of pages a..b
                # straight into the block (`rows` are in range: `_device_rows` checked them;
                # mode="raise" would copy through a temporary)
                np.take(self._dev_rows, rows[a:b], out=self._host_rows[h:h + b - a], mode="clip")
            return
        full = self.pools.full
        compute = torch.cuda.current_stream(full.device)
        stream.wait_stream(compute)  # the KV was written on the compute stream
        with torch.cuda.stream(stream):
            write_runs(full, self.pages, job.device_page_ids, runs, self.chunk_pages)
            event = torch.cuda.Event()
            event.record(stream)
        self._writes.add(event, job.device_page_ids)
        compute.wait_stream(stream)  # freed pages are reused only after the copy

    def restore(self, job: HostRestore) -> RestoreHandle:
        """Start copying host pages into the request's device pages; raises `RestoreFailed`
        at the fault point."""
        if self.fail_restores > 0:
            self.fail_restores -= 1
            raise RestoreFailed(f"restore of {job.num_pages} host pages failed (fault point)")
        handle = RestoreHandle(job.num_pages, job.num_pages * self.page_bytes, time.monotonic())
        runs = host_runs(job.host_page_ids)
        stream = self._restore_stream
        if stream is None:
            rows = self._device_rows(job.device_page_ids)  # [n, L]
            for a, b, h in runs:  # device rows of pages a..b <- host block [b - a, L]
                self._dev_rows[rows[a:b]] = self._host_rows[h:h + b - a]
            return handle
        assert self._write_stream is not None
        full = self.pools.full
        stream.wait_stream(torch.cuda.current_stream(full.device))  # see the module docstring
        stream.wait_stream(self._write_stream)
        with torch.cuda.stream(stream):
            restore_runs(self.pages, full, runs, job.device_page_ids, self.chunk_pages)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)
        return handle

    def _device_rows(self, device_page_ids: list[int]) -> np.ndarray:
        """Rows of `_dev_rows` holding each page's layers: [n, L] intp; raises IndexError for
        a page id outside the pool."""
        return self._page_rows.take(device_page_ids, axis=0)

    def sync_writes_reading(self, device_page_ids: Collection[int]) -> None:
        """Block until no write in flight reads any of `device_page_ids` (before a NIXL
        transfer, which no stream orders, lands in them); no wait when none does."""
        if self._writes and self._writes.wait_for(device_page_ids):
            self.write_waits_total += 1

    def sync_writes(self) -> None:
        """Block until every write made so far is done (each CUDA write recorded an event in
        `_writes`; a CPU write is done when `write` returns)."""
        self._writes.wait_all()


def host_runs(host_page_ids: list[int]) -> Runs:
    """Split page ids into runs that step by +1: (a, b, first page) for each maximal stretch
    `host_page_ids[a:b] == range(first, first + b - a)`, in order. (A plain loop: for the
    few dozen ids of a restore it costs less than any numpy call.)"""
    runs: Runs = []
    a, prev = 0, None
    for i, page in enumerate(host_page_ids):
        if prev is not None and page != prev + 1:
            runs.append((a, i, host_page_ids[a]))
            a = i
        prev = page
    if host_page_ids:
        runs.append((a, len(host_page_ids), host_page_ids[a]))
    return runs


def restore_runs(pages: torch.Tensor, full: torch.Tensor, runs: Runs,
                 device_page_ids: list[int], chunk_pages: int) -> None:
    """The torch restore (the caller picks the stream): each host run of `pages` ([P + 1, L,
    ...], pinned on CUDA) is copied as one block into a staging tensor on `full`'s device, then
    one `index_copy_` scatters it into the device pages of `full` ([L, D + 1, ...]); at most
    `chunk_pages` pages are staged at a time (the staging memory stays bounded)."""
    ids = torch.tensor(device_page_ids, dtype=torch.long).to(full.device, non_blocking=True)
    pages_first = full.transpose(0, 1)  # [D + 1, L, 2, ps, H, D] view of the pool
    for lo in range(0, len(device_page_ids), chunk_pages):
        hi = min(len(device_page_ids), lo + chunk_pages)
        stage = torch.empty((hi - lo, *pages.shape[1:]), dtype=pages.dtype, device=full.device)
        for a, b, h in _clip(runs, lo, hi):  # stage: [hi - lo, L, 2, ps, H, D]
            stage[a - lo:b - lo].copy_(pages[h:h + b - a], non_blocking=True)
        pages_first.index_copy_(0, ids[lo:hi], stage)


def write_runs(full: torch.Tensor, pages: torch.Tensor, device_page_ids: list[int],
               runs: Runs, chunk_pages: int) -> None:
    """The torch write (the caller picks the stream): one `index_select` gathers the device
    pages of `full` ([L, D + 1, ...]) page first, then each host run is copied as one block
    into `pages` ([P + 1, L, ...], pinned on CUDA); at most `chunk_pages` pages at a time."""
    ids = torch.tensor(device_page_ids, dtype=torch.long).to(full.device, non_blocking=True)
    pages_first = full.transpose(0, 1)  # [D + 1, L, 2, ps, H, D] view of the pool
    for lo in range(0, len(device_page_ids), chunk_pages):
        hi = min(len(device_page_ids), lo + chunk_pages)
        gathered = pages_first.index_select(0, ids[lo:hi])  # [hi - lo, L, 2, ps, H, D]
        for a, b, h in _clip(runs, lo, hi):
            pages[h:h + b - a].copy_(gathered[a - lo:b - lo], non_blocking=True)


def _clip(runs: Runs, lo: int, hi: int) -> Runs:
    """The parts of `runs` that fall in positions [lo, hi), their host pages shifted along."""
    return [(max(a, lo), min(b, hi), h + max(a, lo) - a) for a, b, h in runs
            if a < hi and b > lo]
