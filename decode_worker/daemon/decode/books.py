"""The engine's books: what it counted becomes metrics, the pools' and queues' state becomes
gauges and the load, and the accounts are checked (integrity) or emptied (cache flush).

Counts live where the decisions are made: core's `SchedulerStats` (admission, decode pages,
evictions), the request table (ends by status, aborts the shell decided), the stepper (tokens)
and the KV receiver (transfers). `publish` turns them into metrics once per step; nothing else
sets a metric on the compute thread. `load` is replaced (never mutated) by each `publish`; the
event loop reads it for GET /get_load without a lock. Compute thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PoolStats
from decode_worker.core.request import RequestState, held_page_ids
from decode_worker.core.stats import QueueSizes
from decode_worker.daemon.decode.host_tier import HostTier
from decode_worker.daemon.decode.parking import Wait
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.daemon.decode.stepper import DecodeStepper
from decode_worker.io.api.backend import FlushResult, Load
from decode_worker.io.kv.peer import ReceiverStats
from decode_worker.io.metrics import Metrics

log = logging.getLogger(__name__)


class ReceiverView(Protocol):
    """What the books read of the KV receiver: its counts and its peers by protocol."""

    @property
    def stats(self) -> ReceiverStats: ...

    def peers_by_protocol(self) -> dict[str, int]: ...


def receiver_totals(stats: ReceiverStats) -> dict[str, int | dict[str, int]]:
    """The KV receiver's counts as `Metrics.set_totals` takes them."""
    return {"transfer_bytes": stats.bytes_received,
            "transfer_received_tokens": stats.tokens_received,
            "transfer_failures": dict(stats.failures),
            "transfer_quiesce_expired": stats.quiesce_expired,
            "transfer_bad_frames": stats.bad_frames,
            "transfer_kv_checksum_failures": stats.kv_checksum_failures}


PUBLISH_EVERY_S = 0.005
# of the host tier's counts: those that are Prometheus counters (`decode_worker_host_*_total`),
# and those `/server_info`'s `host_tier` shows
_HOST_TOTALS = ("hit_tokens", "restored_tokens", "restored_bytes", "written_bytes",
                "evicted_pages", "write_failures", "restore_failures", "write_waits")
_HOST_LIVE = ("hit_tokens", "restored_tokens", "restores_in_flight", "restore_failures",
              "written_bytes")


class Books:
    """Metrics, gauges, load, flush and integrity over the engine's parts."""

    def __init__(self, kv_ctx: KVContext, table: RequestTable, receiver: ReceiverView,
                 stepper: DecodeStepper, metrics: Metrics, host_tier: HostTier | None) -> None:
        self.kv_ctx, self.table, self.receiver, self.stepper = kv_ctx, table, receiver, stepper
        self.metrics, self.host_tier = metrics, host_tier
        # the host tier's last published pages and counters (read from the event loop: an
        # immutable dict swapped whole, as `load`)
        self.host_live: dict[str, int] = {}
        self._host_published: tuple[object, ...] | None = None  # what the last publish saw
        self.load = Load()
        self._next_publish = 0.0

    def publish(self, now: float = 0.0, *, decoding: bool = False) -> None:
        """The load, every step; counters up to what was counted and the pool and queue
        gauges every step while idle, at most every `PUBLISH_EVERY_S` while decoding (a scrape
        is seconds apart; a decode step may be a millisecond)."""
        stats = {"full": self._pool_stats("full"), "swa": self._pool_stats("swa")}
        q = self.queue_sizes()
        self.load = self._load(stats, q)
        if decoding and now < self._next_publish:
            return
        self._next_publish = now + PUBLISH_EVERY_S
        self._publish_counts()
        for pool, st in stats.items():
            if st is not None:
                self.metrics.update_pool(pool, available=st.available, used=st.total - st.available,
                                         evictable=st.evictable, protected=st.protected,
                                         total=st.total)
        landing = self.table.fetcher.landing
        if landing is not None:  # pages held by transfers in flight, nothing cached
            book = landing.book
            self.metrics.update_pool("landing", available=book.num_free, evictable=0,
                                     used=book.num_total - book.num_free, protected=0,
                                     total=book.num_total)
        self.metrics.update_queues(prealloc=q.prealloc, transfer=q.transfer, running=q.running)
        self._publish_host()

    def _publish_host(self) -> None:
        """The host tier's pages (pool="host" beside the device pools) and its counters; no
        metric is touched when none of them moved since the last publish (a host tier without
        traffic costs one comparison of a few ints per publish)."""
        ht, tree = self.host_tier, self.kv_ctx.tree
        if ht is None or tree is None:
            return
        st, hst = tree.host_stats_pages(), tree.host_stats
        counts = {  # the one list of the host tier's counts
            "hit_tokens": self.kv_ctx.stats.host_hit_tokens_total,
            "restored_tokens": ht.restored_pages_total * self.kv_ctx.page_size,
            "restored_bytes": ht.restored_bytes_total,
            "written_bytes": ht.pool.written_bytes_total,
            "evicted_pages": hst.host_evicted_pages_total,
            "write_failures": hst.write_failures_total,
            "restore_failures": ht.restore_failures_total,
            "write_waits": ht.pool.write_waits_total,
            "restores_in_flight": ht.num_restoring,
        }
        seen = (st, counts)
        if seen == self._host_published:  # a done restore moved `restored_pages_total`
            return
        self._host_published = seen
        self.metrics.update_pool("host", available=st.available, used=st.total - st.available,
                                 evictable=st.evictable, protected=st.protected, total=st.total)
        self.metrics.set_totals({f"host_{k}": counts[k] for k in _HOST_TOTALS})
        self.metrics.observe_host_restores(ht.restore_durations_s)
        ht.restore_durations_s.clear()
        self.host_live = {
            "pages_used": st.total - st.available, "pages_evictable": st.evictable,
            "pages_protected": st.protected, "pages_available": st.available,
            **{k: counts[k] for k in _HOST_LIVE}}

    def _load(self, stats: dict[str, PoolStats | None], q: QueueSizes) -> Load:
        # tokens in use: pages held by requests or locked for them, not the evictable cache (as
        # SGLang: the larger of the two pools), plus the prompts still queued for pages
        in_use = max((st.total - st.available - st.evictable for st in stats.values()
                      if st is not None), default=0) * self.kv_ctx.page_size
        queued = (sum(lv.req.fill_len for lv in self.table.lives.values()
                      if lv.req.state is RequestState.QUEUED) if q.prealloc else 0)
        kst = self.kv_ctx.stats
        hit_rate = (kst.prefix_hit_tokens_total / kst.prefix_query_tokens_total
                    if kst.prefix_query_tokens_total else 0.0)
        return Load(num_running_reqs=q.running, num_waiting_reqs=q.prealloc + q.transfer,
                    num_tokens=in_use + queued, measured_at=time.perf_counter(),
                    num_used_tokens=in_use, num_queued_tokens=queued,
                    num_prealloc_reqs=q.prealloc, num_transfer_reqs=q.transfer,
                    cache_hit_rate=hit_rate)

    def queue_sizes(self) -> QueueSizes:
        # requests still learning their peer's protocol wait before the prealloc queue: count
        # them with it
        table = self.table
        return QueueSizes(prealloc=table.queue.num_queued + table.parked.count(Wait.PEER),
                          transfer=table.num_fetching, running=len(table.running))

    def _publish_counts(self) -> None:
        st, table, rx = self.kv_ctx.stats, self.table, self.receiver.stats
        aborts = dict(table.aborts_total)
        for reason, n in st.aborts_total.items():
            aborts[reason] = aborts.get(reason, 0) + n
        self.metrics.set_totals({
            "admissions": st.admissions_total,
            "admission_passes": st.admission_passes_total,
            "retractions": st.retractions_total,
            "prefix_query_tokens": st.prefix_query_tokens_total,
            "prefix_hit_tokens": st.prefix_hit_tokens_total,
            "evicted_pages": {"full": st.evicted_full_pages_total,
                              "swa": st.evicted_swa_pages_total},
            "swa_released_pages": st.swa_pages_released_total,
            "aborts": aborts,
            "requests": dict(table.requests_total),
            "generated_tokens": self.stepper.generated_tokens_total,
            **receiver_totals(rx),
        })
        self.metrics.observe_transfer_samples(rx.take_samples())
        self._publish_spec()
        self.metrics.set_peers(self.receiver.peers_by_protocol())

    def _publish_spec(self) -> None:
        """Speculative decoding's counts, and the accept lengths and verify times since the
        last publish (drained)."""
        spec, verifier = self.stepper.spec, self.stepper.verifier
        if spec is None or verifier is None:
            return
        st = spec.stats
        self.metrics.set_totals({"spec_proposed_tokens": st.proposed_total,
                                 "spec_accepted_tokens": st.accepted_total,
                                 "spec_verify_steps": st.verify_steps_total})
        self.metrics.observe_spec(st.accept_lengths, verifier.verify_seconds)
        st.accept_lengths.clear()
        verifier.verify_seconds.clear()

    def flush_cache(self) -> FlushResult:
        """Evict every tree entry no request holds (full values with their SWA values, then SWA
        values left on held nodes), back into the allocators; then check the books (FatalError
        if they do not balance). Refused, changing nothing, while any request is running or
        waiting (queued, transferring, or waiting for a failed transfer's pages), as SGLang."""
        num_running = len(self.table.running)
        num_waiting = len(self.table.holders()) - num_running
        if num_running or num_waiting:
            msg = (f"cache not flushed: {num_running} running and {num_waiting} waiting "
                   f"requests (flush when idle, or pass ?timeout=S to wait)")
            log.warning("%s", msg)
            return FlushResult(False, msg)
        ctx = self.kv_ctx
        if ctx.tree is None:
            log.info("cache flush: the decode radix cache is off, nothing cached")
            return FlushResult(True)
        full_free, swa_free = ctx.full.num_free, ctx.swa.num_free if ctx.swa else 0
        ctx.tree.flush()  # everything evictable, the host tier too; KV events: AllBlocksCleared
        self.check_integrity()
        n_full = ctx.full.num_free - full_free
        n_swa = ctx.swa.num_free - swa_free if ctx.swa else 0
        log.info("cache flushed: %d full and %d SWA pages back in the pools", n_full, n_swa)
        return FlushResult(True, num_full_pages=n_full, num_swa_pages=n_swa)

    def check_integrity(self) -> None:
        """Every pool page is free, cached by the tree or held by exactly one request (live, or
        ended while a transfer still holds its pages), and every landing page by exactly one
        transfer in flight. Raises FatalError otherwise."""
        ctx, lot = self.kv_ctx, self.table.parked
        lot.check_integrity()
        landing = self.table.fetcher.landing
        if landing is not None:
            landing.book.check_integrity(lot.transfer_ids())
        held_full, held_swa = held_page_ids(self.table.holders(), ctx.page_size)
        if ctx.tree is not None:
            ctx.tree.check_integrity(held_full, held_swa)
        else:
            ctx.full.check_integrity()
            if ctx.swa is not None:
                ctx.swa.check_integrity()

    def snapshot(self) -> str:
        """One line for the log when a step fails."""
        ctx, q = self.kv_ctx, self.queue_sizes()
        return (f"running={q.running} queued={q.prealloc} transfers={q.transfer} "
                f"lives={len(self.table.lives)} full_free={ctx.full.num_free} "
                f"swa_free={ctx.swa.num_free if ctx.swa else 0}")

    def _pool_stats(self, pool: str) -> PoolStats | None:
        ctx = self.kv_ctx
        if ctx.tree is not None:
            return ctx.tree.full_stats() if pool == "full" else (
                ctx.tree.swa_stats() if ctx.swa is not None else None)
        alloc = ctx.full if pool == "full" else ctx.swa
        if alloc is None:
            return None
        held = alloc.num_total - alloc.num_free
        return PoolStats(total=alloc.num_total, available=alloc.num_free, evictable=0,
                         protected=0, held_by_requests=held)
