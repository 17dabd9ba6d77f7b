"""The host tier's memory: full-attention KV pages in host RAM (pinned on CUDA), and the copies
device -> host (write) and host -> device (restore).

Layout mirrors the device full pool, layer first:
`host: [num_full_layers, num_host_pages + 1, 2, page_size, kv_heads, head_dim]` (page 0 unused),
so one copy per direction moves whole pages of every full layer with one indexed copy.
On CUDA each direction has its own stream: a write waits for the compute stream (the KV it
reads was written there) and the compute stream waits for the write before it reuses pages
(GPU-side waits); the write lands in a pinned staging buffer and is scattered into the host
pages by the host thread once its event says the copy is done (a later write polls, a
restore and `sync_writes` wait): never before, since a non-blocking device -> host copy
fills its buffer after the call returns. A restore records an event the caller polls.
On CPU the same calls copy synchronously through numpy views of the two tensors: runs of
page ids that step by one (up or down, each side its own way, as the LIFO allocators hand
them out) as one strided slice copy each, else one gather and one scatter of whole
(layer, page) rows; torch's advanced indexing measured at under half a plain copy's
bandwidth for these row sizes (`scripts/bench_host_tier.py`). `fail_restores` is the fault
point for tests: the next that many restores raise `RestoreFailed` (nothing is copied).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from decode_worker.core.host_tier import HostRestore, HostWrite
from decode_worker.device.kv_pool import KVPools
from decode_worker.errors import TransferError


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


class HostKVPool:
    """Host pages of full-attention KV; the compute thread owns it."""

    def __init__(self, pools: KVPools, num_pages: int) -> None:
        self.pools = pools
        dev = pools.full
        self.num_pages = num_pages
        self.is_cuda = dev.is_cuda
        shape = (dev.shape[0], num_pages + 1, *dev.shape[2:])
        # host: [num_full_layers, num_host_pages + 1, 2, page_size, kv_heads, head_dim]
        self.host = torch.zeros(shape, dtype=dev.dtype, pin_memory=self.is_cuda)
        self.page_bytes = dev[:, 0].numel() * dev.element_size()  # all full layers of one page
        self.fail_restores = 0
        self.written_bytes_total = 0
        self._write_stream = torch.cuda.Stream(dev.device) if self.is_cuda else None
        self._restore_stream = torch.cuda.Stream(dev.device) if self.is_cuda else None
        # CUDA writes copied to pinned staging, not yet in `host`: (done, staging, host ids)
        self._landing: deque[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = deque()
        if not self.is_cuda:
            num_layers = dev.shape[0]
            # rows: [num_full_layers * (pages + 1), page_bytes_per_layer] u8, views of the pools
            self._dev_rows = _rows(dev)
            self._host_rows = _rows(self.host)
            self._dev_base = np.arange(num_layers)[:, None] * dev.shape[1]  # [L, 1]
            self._host_base = np.arange(num_layers)[:, None] * (num_pages + 1)  # [L, 1]

    def total_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def write(self, job: HostWrite) -> None:
        """Copy device pages to host pages (the tree's `write_sink`)."""
        self.written_bytes_total += len(job.host_page_ids) * self.page_bytes
        stream = self._write_stream
        if stream is None:
            self._copy_cpu(self._dev_rows, self._dev_base, job.device_page_ids,
                           self._host_rows, self._host_base, job.host_page_ids)
            return
        full = self.pools.full
        dev_ids = torch.tensor(job.device_page_ids, dtype=torch.long)  # [n]
        host_ids = torch.tensor(job.host_page_ids, dtype=torch.long)  # [n]
        compute = torch.cuda.current_stream(full.device)
        stream.wait_stream(compute)  # the KV was written on the compute stream
        with torch.cuda.stream(stream):
            gathered = full[:, dev_ids.to(full.device, non_blocking=True)]  # [L, n, 2, ps, H, D]
            staging = torch.empty(gathered.shape, dtype=full.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        compute.wait_stream(stream)  # freed pages are reused only after the copy
        self._landing.append((done, staging, host_ids))
        self._land_writes(wait=False)

    def _land_writes(self, *, wait: bool) -> None:
        """Scatter finished CUDA writes into the host pages, oldest first (a later write of a
        host page lands after an earlier one); `wait`: all of them, blocking until done."""
        landing = self._landing
        while landing and (wait or landing[0][0].query()):
            done, staging, host_ids = landing.popleft()
            done.synchronize()
            self.host[:, host_ids] = staging  # [L, n, 2, ps, H, D]

    def restore(self, job: HostRestore) -> RestoreHandle:
        """Start copying host pages into the request's device pages; raises `RestoreFailed`
        at the fault point."""
        if self.fail_restores > 0:
            self.fail_restores -= 1
            raise RestoreFailed(f"restore of {job.num_pages} host pages failed (fault point)")
        handle = RestoreHandle(job.num_pages, job.num_pages * self.page_bytes, time.monotonic())
        stream = self._restore_stream
        if stream is None:
            self._copy_cpu(self._host_rows, self._host_base, job.host_page_ids,
                           self._dev_rows, self._dev_base, job.device_page_ids)
            return handle
        host_ids = torch.tensor(job.host_page_ids, dtype=torch.long)  # [n]
        dev_ids = torch.tensor(job.device_page_ids, dtype=torch.long)  # [n]
        dev = self.pools.full.device
        self._land_writes(wait=True)  # a host page read below may still be on its way
        with torch.cuda.stream(stream):
            staged = self.host[:, host_ids].pin_memory()  # [L, n, 2, ps, H, D]
            self.pools.full[:, dev_ids.to(dev, non_blocking=True)] = staged.to(
                dev, non_blocking=True)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)
        return handle

    @staticmethod
    def _copy_cpu(src: np.ndarray, src_base: np.ndarray, src_ids: list[int],
                  dst: np.ndarray, dst_base: np.ndarray, dst_ids: list[int]) -> None:
        """Copy page `src_ids[i]` of `src` to page `dst_ids[i]` of `dst`, every layer (row
        views of `_rows`; `*_base`: [L, 1] first row of each layer)."""
        src_np = np.asarray(src_ids, dtype=np.int64)
        dst_np = np.asarray(dst_ids, dtype=np.int64)
        runs = _runs(src_ids, dst_ids) if _mostly_runs(src_np, dst_np) else None
        if runs is not None:
            num_layers = len(src_base)
            src3 = src.reshape(num_layers, -1, src.shape[1])  # [L, pages + 1, row] u8
            dst3 = dst.reshape(num_layers, -1, dst.shape[1])
            for s, d in runs:
                dst3[:, d] = src3[:, s]
            return
        dst[(dst_base + dst_np).ravel()] = src[(src_base + src_np).ravel()]

    def sync_writes(self) -> None:
        """Block until every write made so far is done (before a NIXL transfer, which no stream
        orders, may land in pages a write still reads)."""
        if self._write_stream is not None:
            self._write_stream.synchronize()
            self._land_writes(wait=True)


def _rows(pool: torch.Tensor) -> np.ndarray:
    """A CPU pool `[L, pages, ...]` as a numpy view `[L * pages, bytes of one page of one
    layer]` u8 (shares the memory)."""
    return pool.view(pool.shape[0] * pool.shape[1], -1).view(torch.uint8).numpy()


def _mostly_runs(src: np.ndarray, dst: np.ndarray) -> bool:
    """At least three quarters of the neighbouring pairs step by one on both sides."""
    if len(src) < 2:
        return True
    steps = (np.abs(np.diff(src)) == 1) & (np.abs(np.diff(dst)) == 1)
    return int(steps.sum()) * 4 >= 3 * (len(src) - 1)


def _runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[slice, slice]] | None:
    """Split the page pairs into runs where each side steps by +1 or -1 (its own way); a
    run is one (src slice, dst slice). None when there are more than a quarter as many runs
    as pages (then a gather and a scatter are faster). Page ids are >= 1, so a run going
    down never needs a negative stop."""
    n = len(src_ids)
    out: list[tuple[slice, slice]] = []
    limit = max(4, n // 4)
    i = 0
    while i < n:
        s0, d0 = src_ids[i], dst_ids[i]
        ss = sd = 1
        j = i + 1
        if j < n and abs(src_ids[j] - s0) == 1 and abs(dst_ids[j] - d0) == 1:
            ss, sd = src_ids[j] - s0, dst_ids[j] - d0
            while j < n and src_ids[j] - src_ids[j - 1] == ss and dst_ids[j] - dst_ids[j - 1] == sd:
                j += 1
        k = j - i
        out.append((slice(s0, s0 + ss * k, ss), slice(d0, d0 + sd * k, sd)))
        if len(out) > limit:
            return None
        i = j
    return out
