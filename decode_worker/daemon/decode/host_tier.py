"""Wiring of the host tier for the decode engine: size it, build the host page allocator and
the host KV pool, and start restores for admitted requests and count them as they complete (the
compute thread owns all of it)."""

from __future__ import annotations

import logging
import os

from decode_worker.core.host_tier import HostRestore, WritePolicy
from decode_worker.core.memory_budget import plan_host_pages
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.device.host_pool import HostKVPool, RestoreFailed, RestoreHandle
from decode_worker.device.kv_pool import KVPools
from decode_worker.settings import CacheSettings

log = logging.getLogger(__name__)


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else physical pages free."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_enabled(c: CacheSettings) -> bool:
    """`cache.hierarchical_cache`, unset = on where the decode radix cache is on."""
    return c.decode_radix_cache if c.hierarchical_cache is None else c.hierarchical_cache


class HostTier:
    """The host page allocator (given to the tree), the host KV pool, and restore counters."""

    def __init__(self, c: CacheSettings, pools: KVPools, num_device_pages: int) -> None:
        page_bytes = pools.full[:, 0].numel() * pools.full.element_size()
        pages, note = plan_host_pages(num_device_pages, page_bytes, c.hicache_ratio,
                                      c.hicache_size_gb, available_host_bytes())
        self.policy = WritePolicy(c.hicache_write_policy)
        self.pages = PageAllocator(pages, "host")
        self.pool = HostKVPool(pools, pages)
        self.note = f"host tier {pages} pages = {note}, {self.policy.value}"
        self.restored_pages_total = 0
        self.restored_bytes_total = 0
        self.restore_failures_total = 0
        self.restore_durations_s: list[float] = []  # drained by the books into the histogram
        self._in_flight: list[RestoreHandle] = []
        log.info("%s", self.note)

    def attach(self, tree: UnifiedRadixTree) -> None:
        tree.write_sink = self.pool.write

    @property
    def num_restoring(self) -> int:
        """Restores started and not yet seen done by `poll`."""
        return len(self._in_flight)

    def start_restore(self, job: HostRestore) -> RestoreHandle:
        """Start copying a request's host hits into its device pages (on CUDA on the restore
        stream: the host thread does not wait; on CPU the copy is made now). The request
        keeps the handle and joins the batch only once it `is_done()`. Raises
        `RestoreFailed` (the caller aborts that request alone; its pages go back with it)."""
        try:
            handle = self.pool.restore(job)
        except RestoreFailed:
            self.restore_failures_total += 1
            raise
        self._in_flight.append(handle)
        return handle

    def poll(self, now: float) -> None:
        """Count the restores done since the last poll: pages, bytes, and the duration from
        the start to the poll that saw it done (the histogram's resolution is one step)."""
        if not self._in_flight:
            return
        still = []
        for h in self._in_flight:
            if not h.is_done():
                still.append(h)
                continue
            self.restored_pages_total += h.num_pages
            self.restored_bytes_total += h.num_bytes
            self.restore_durations_s.append(max(0.0, now - h.started_s))
        self._in_flight = still
