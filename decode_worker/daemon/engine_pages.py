"""Pages while decoding: growth, retraction, gauges and load, cache flushes, and the integrity
check.

A mixin of `DecodeEngine` (compute thread only).
"""

from __future__ import annotations

import logging
import time

from decode_worker.core.pages import PoolStats
from decode_worker.core.request import RequestState, held_page_ids
from decode_worker.daemon.engine_state import EngineState
from decode_worker.daemon.live import LiveRequest
from decode_worker.io.api.backend import FlushResult, Load

log = logging.getLogger(__name__)


class PageOps(EngineState):
    """Page bookkeeping of the running batch.

    `load` is replaced (never mutated) once per step by `publish_gauges`; the event loop reads
    it for GET /get_load without a lock.
    """

    load: Load = Load()

    def plan_decode_pages(self, now: float) -> list[LiveRequest]:
        """Give every running request the pages its next token needs (sliding SWA pages out of
        the window); requests retracted for pages go back to the prealloc queue, their
        computed KV cached. Returns the requests that run this step."""
        self.running = [lv for lv in self.running if lv.req.state is RequestState.RUNNING]
        by_rid = {lv.rid: lv for lv in self.running}
        plan = self.decode_alloc.prepare_step([lv.req for lv in self.running], now)
        if plan.retracted:
            self.queue.requeue(plan.retracted, now)
            self.metrics.inc_retraction(len(plan.retracted))
            for req in plan.retracted:
                by_rid[req.rid].transfer_id = None
                log.info("rid=%s retracted after %d tokens", req.rid, len(req.output_ids))
        return [by_rid[r.rid] for r in plan.runnable]

    def publish_gauges(self) -> None:
        """Pool and queue gauges, and the load for /get_load."""
        stats = {"full": self._pool_stats("full"), "swa": self._pool_stats("swa")}
        for pool, st in stats.items():
            if st is not None:
                self.metrics.update_pool(pool, available=st.available, used=st.total - st.available,
                                         evictable=st.evictable, protected=st.protected,
                                         total=st.total)
        in_transfer = len(self.by_transfer)
        self.metrics.update_queues(prealloc=self.queue.num_queued, transfer=in_transfer,
                                   running=len(self.running))
        # tokens in use: pages held by requests or locked for them, not the evictable cache (as
        # SGLang: the larger of the two pools), plus the prompts still queued for pages
        in_use = max((st.total - st.available - st.evictable for st in stats.values()
                      if st is not None), default=0) * self.page_size
        queued = (sum(lv.req.fill_len for lv in self.lives.values()
                      if lv.req.state is RequestState.QUEUED) if self.queue.num_queued else 0)
        self.load = Load(num_running_reqs=len(self.running),
                         num_waiting_reqs=self.queue.num_queued + in_transfer,
                         num_tokens=in_use + queued, measured_at=time.perf_counter())

    def flush_cache(self) -> FlushResult:
        """Evict every tree entry no request holds (full values with their SWA values, then SWA
        values left on held nodes), back into the allocators; then check the books (FatalError
        if they do not balance). Refused, changing nothing, while any request is running or
        waiting (queued, transferring, or waiting for a failed transfer's pages), as SGLang."""
        num_running = len(self.running)
        num_waiting = len(self.lives) - num_running + sum(
            1 for lv in self.by_transfer.values() if self.lives.get(lv.rid) is not lv)
        if num_running or num_waiting:
            msg = (f"cache not flushed: {num_running} running and {num_waiting} waiting "
                   f"requests (flush when idle, or pass ?timeout=S to wait)")
            log.warning("%s", msg)
            return FlushResult(False, msg)
        if self.tree is None:
            log.info("cache flush: the decode radix cache is off, nothing cached")
            return FlushResult(True)
        full_free, swa_free = self.full.num_free, self.swa.num_free if self.swa else 0
        self.tree.evict_full(self.full.num_total)  # at most everything evictable
        if self.swa is not None:
            self.tree.evict_swa(self.swa.num_total)
        self.check_integrity()
        n_full = self.full.num_free - full_free
        n_swa = self.swa.num_free - swa_free if self.swa else 0
        log.info("cache flushed: %d full and %d SWA pages back in the pools", n_full, n_swa)
        return FlushResult(True, num_full_pages=n_full, num_swa_pages=n_swa)

    def check_integrity(self) -> None:
        """Every pool page is free, cached by the tree or held by exactly one live request."""
        held_full, held_swa = held_page_ids([lv.req for lv in self.lives.values()],
                                            self.page_size)
        if self.tree is not None:
            self.tree.check_integrity(held_full, held_swa)
        else:
            self.full.check_integrity()
            if self.swa is not None:
                self.swa.check_integrity()

    def snapshot(self) -> str:
        """One line for the log when a step fails."""
        return (f"running={len(self.running)} queued={self.queue.num_queued} "
                f"transfers={len(self.by_transfer)} lives={len(self.lives)} "
                f"full_free={self.full.num_free} "
                f"swa_free={self.swa.num_free if self.swa else 0}")

    def _pool_stats(self, pool: str) -> PoolStats | None:
        if self.tree is not None:
            return self.tree.full_stats() if pool == "full" else (
                self.tree.swa_stats() if self.swa is not None else None)
        alloc = self.full if pool == "full" else self.swa
        if alloc is None:
            return None
        held = alloc.num_total - alloc.num_free
        return PoolStats(total=alloc.num_total, available=alloc.num_free, evictable=0,
                         protected=0, held_by_requests=held)
