"""Wiring of the host tier for the decode engine: size it, build the host page allocator and
the host KV pool, and start restores for admitted requests and count them as they complete (the
compute thread owns all of it)."""

from __future__ import annotations

from decode_worker.core.host_tier import HostRestore, WritePolicy
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.daemon.shared.host_plan import HostPlan
from decode_worker.device.host_pool import HostKVPool, RestoreFailed, RestoreHandle
from decode_worker.device.kv_pool import KVPools


class HostTier:
    """The host page allocator (given to the tree), the host KV pool, and restore counters."""

    def __init__(self, plan: HostPlan, pools: KVPools) -> None:
        self.plan = plan
        self.policy = WritePolicy(plan.write_policy)
        self.pages = PageAllocator(plan.num_pages, "host")
        self.pool = HostKVPool(pools, plan.num_pages)
        self.note = plan.describe()
        self.restored_pages_total = 0
        self.restored_bytes_total = 0
        self.restore_failures_total = 0
        self.restore_durations_s: list[float] = []  # drained by the books into the histogram
        self._in_flight: list[RestoreHandle] = []

    def attach(self, tree: UnifiedRadixTree) -> None:
        tree.write_sink = self.pool.write

    @property
    def num_restoring(self) -> int:
        """Restores started and not yet seen done by `count_done_restores`."""
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

    def count_done_restores(self, now: float) -> None:
        """Count the restores done since the last call: pages, bytes, and the duration from
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
