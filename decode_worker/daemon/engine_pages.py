"""Pages while decoding: growth, retraction, gauges, and the integrity check.

A mixin of `DecodeEngine` (compute thread only).
"""

from __future__ import annotations

import logging

from decode_worker.core.pages import PoolStats
from decode_worker.core.request import RequestState, held_page_ids
from decode_worker.daemon.engine_state import EngineState
from decode_worker.daemon.live import LiveRequest

log = logging.getLogger(__name__)


class PageOps(EngineState):
    """Page bookkeeping of the running batch."""

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
        """Pool and queue gauges, and the counters the core keeps (as deltas)."""
        stats = {"full": self._pool_stats("full"), "swa": self._pool_stats("swa")}
        for pool, st in stats.items():
            if st is not None:
                self.metrics.update_pool(pool, available=st.available, used=st.total - st.available,
                                         evictable=st.evictable, protected=st.protected,
                                         total=st.total)
        in_transfer = len(self.by_transfer)
        self.metrics.update_queues(prealloc=self.queue.num_queued, transfer=in_transfer,
                                   running=len(self.running))

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
