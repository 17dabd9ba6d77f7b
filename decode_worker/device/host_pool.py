"""The host tier's memory: full-attention KV pages in host RAM (pinned on CUDA), and the copies
device -> host (write) and host -> device (restore).

Layout mirrors the device full pool, layer first:
`host: [num_full_layers, num_host_pages + 1, 2, page_size, kv_heads, head_dim]` (page 0 unused),
so one copy per direction moves whole pages of every full layer with one indexed copy.
On CUDA each direction has its own stream: a write waits for the compute stream (the KV it
reads was written there) and the compute stream waits for the write before it reuses pages
(GPU-side waits, the host thread never blocks on them); a restore records an event the caller
polls. On CPU the same calls copy synchronously. `fail_restores` is the fault point for tests:
the next that many restores raise `RestoreFailed` (nothing is copied).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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

    def total_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def write(self, job: HostWrite) -> None:
        """Copy device pages to host pages (the tree's `write_sink`)."""
        dev_ids = torch.tensor(job.device_page_ids, dtype=torch.long)  # [n]
        host_ids = torch.tensor(job.host_page_ids, dtype=torch.long)  # [n]
        self.written_bytes_total += len(job.host_page_ids) * self.page_bytes
        stream = self._write_stream
        if stream is None:
            self.host[:, host_ids] = self.pools.full[:, dev_ids]  # [L, n, 2, ps, H, D]
            return
        compute = torch.cuda.current_stream(self.pools.full.device)
        stream.wait_stream(compute)  # the KV was written on the compute stream
        with torch.cuda.stream(stream):
            staged = self.pools.full[:, dev_ids.to(self.pools.full.device)]  # [L, n, 2, ps, H, D]
            self.host[:, host_ids] = staged.to("cpu", non_blocking=True)
        compute.wait_stream(stream)  # freed pages are reused only after the copy

    def restore(self, job: HostRestore) -> RestoreHandle:
        """Start copying host pages into the request's device pages; raises `RestoreFailed`
        at the fault point."""
        if self.fail_restores > 0:
            self.fail_restores -= 1
            raise RestoreFailed(f"restore of {job.num_pages} host pages failed (fault point)")
        host_ids = torch.tensor(job.host_page_ids, dtype=torch.long)  # [n]
        dev_ids = torch.tensor(job.device_page_ids, dtype=torch.long)  # [n]
        handle = RestoreHandle(job.num_pages, job.num_pages * self.page_bytes, time.monotonic())
        stream = self._restore_stream
        if stream is None:
            self.pools.full[:, dev_ids] = self.host[:, host_ids]  # [L, n, 2, ps, H, D]
            return handle
        dev = self.pools.full.device
        if self._write_stream is not None:
            stream.wait_stream(self._write_stream)  # a host page may still be being written
        with torch.cuda.stream(stream):
            staged = self.host[:, host_ids].pin_memory()  # [L, n, 2, ps, H, D]
            self.pools.full[:, dev_ids.to(dev, non_blocking=True)] = staged.to(
                dev, non_blocking=True)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)
        return handle

    def sync_writes(self) -> None:
        """Block until every write made so far is done (before a NIXL transfer, which no stream
        orders, may land in pages a write still reads)."""
        if self._write_stream is not None:
            self._write_stream.synchronize()
