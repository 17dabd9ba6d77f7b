"""The request table: every request the engine knows, where each one is, the one exit every
request leaves by (`end`) and the one poll that moves waiting requests on (`poll`).

The engine enters it once a step (`step`): the step's commands (arrivals, cancels), the poll,
the prealloc queue's pass (arrivals join it there), the fetch of what it admitted; the READY
requests it returns join the batch. The stepper ends requests through `end`. What concerns
prefill peers (their protocol, posting transfers, their events, ending rooms) is in
`peer_waits.py`, mixed in.

A request is in exactly one place: the step's arrivals (until this step's pass), the prealloc
queue (QUEUED, RETRACTED), the running batch (RUNNING), or parked (`parking.py`: waiting for
its peer's protocol, its transfer, its restore, its place in the batch; or, once ended, for
what still writes its pages). `end`
answers the client once (`Ended`), counts the end, and releases exactly what the request held:

```
where at end          released by end
arrivals, prealloc    its place there (it holds no pages)
queue
PEER / START          at once: nothing / its pages and prefix lock
LANDING               at once: its pages and prefix lock (no transfer was posted); after its
                      restore, if one still writes its pages
TRANSFER / RESTORE    nothing yet: the peer or the host tier may still write its pages; the
                      record stays, and `poll` releases them once the writer stopped
running batch         its pages and prefix lock (valid KV stays cached in the tree), or, while
                      a launched step still uses them, once that step is waited for (STEPS);
                      its valid KV enters the tree at once even then, so the step's KV events,
                      published before its answer leaves, name it
already terminal      nothing (admission aborted it and returned its pages itself)
```
Compute thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from decode_worker.core.admission import Abort, Admit, Decision, PreallocQueue
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.kv_context import KVContext
from decode_worker.core.request import TERMINAL, DecodeRequest, RequestState
from decode_worker.daemon.decode.batch import RunningBatch
from decode_worker.daemon.decode.bridge import (
    FINISH_REASONS,
    AbortRequest,
    AddRequest,
    Command,
    Drain,
    FinishRequest,
    Outbox,
    RefuseRequest,
)
from decode_worker.daemon.decode.fetcher import KVFetcher
from decode_worker.daemon.decode.host_tier import HostTier
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.parking import Parked, ParkingLot, Wait
from decode_worker.daemon.decode.peer_waits import PeerWaits, TransferStopper
from decode_worker.device.host_pool import RestoreFailed
from decode_worker.errors import DecodeWorkerError

log = logging.getLogger(__name__)
_EXPIRE_EVERY_S = 0.01  # how often the prealloc queue's deadlines are checked


class RequestTable(PeerWaits):
    """The live requests by rid, the running batch, the parked requests (live or ended).

    `counts`: requests ended by status, and aborts by reason for those the shell decided
    (admission counts its own in `SchedulerStats`); the books export both.
    """

    def __init__(self, kv_ctx: KVContext, queue: PreallocQueue, decode_alloc: DecodeAllocator,
                 transfers: TransferStopper, fetcher: KVFetcher, outbox: Outbox,
                 running: RunningBatch, on_end: Callable[[str, str], None] | None = None, *,
                 host_tier: HostTier | None = None, eos_ids: frozenset[int] = frozenset(),
                 vocab_size: int | None = None) -> None:
        """`on_end(rid, status)` is told of every end (the drafter forgets the request).
        `host_tier`: restores host hits into admitted requests' pages. `eos_ids`: the model's
        end tokens; `vocab_size`: prompts with ids outside it end as `bad_request` (None: not
        checked, for rigs without a model)."""
        self.kv_ctx, self.queue, self.decode_alloc = kv_ctx, queue, decode_alloc
        self.transfers, self.fetcher, self.outbox, self.running = (transfers, fetcher, outbox,
                                                                   running)
        self.host_tier, self.eos_ids, self.vocab_size = host_tier, eos_ids, vocab_size
        self.lives: dict[str, LiveRequest] = {}
        self.parked = ParkingLot()
        self.arrivals: list[LiveRequest] = []  # join the prealloc queue at this step's pass
        self.on_end = on_end
        self.requests_total: Counter[str] = Counter()  # finished / aborted / failed
        self.aborts_total: Counter[str] = Counter()  # shell-decided aborts, by reason
        self._drain_deadline: float | None = None
        self._next_expire = 0.0

    # -- one engine step -----------------------------------------------------------------------
    def step(self, now: float, commands: Iterable[Command] = ()) -> list[LiveRequest]:
        """The requests' part of an engine step: the step's commands (arrivals, cancels,
        refusals, a drain; the engine's own are skipped), then `poll`, then the admission
        pass (admitted requests fetch their KV, the rest end), then the deadlines. Returns the
        READY requests, in arrival order: they leave the lot for the batch."""
        for cmd in commands:
            self._command(cmd, now)
        self.poll(now)
        self._admit(now)
        out = []
        for rec in self.parked.at(Wait.START):
            self.parked.move(rec, None)
            out.append(rec.live)
        return out

    def _command(self, cmd: Command, now: float) -> None:
        if isinstance(cmd, AddRequest):
            self._add(cmd, now)
        elif isinstance(cmd, AbortRequest | FinishRequest):
            live = self.lives.get(cmd.rid)
            if live is not None:  # client abort, stop string ("stop": it finished) or drain
                reason = cmd.reason if isinstance(cmd, AbortRequest) else "stop"
                self.end(live, reason, "" if reason == "stop" else f"aborted: {reason}", now)
        elif isinstance(cmd, RefuseRequest):
            self.refuse(cmd)
        elif isinstance(cmd, Drain):
            self._drain_deadline = now + cmd.grace_s

    def _add(self, cmd: AddRequest, now: float) -> None:
        """A new request: it waits for its peer's protocol, or joins the prealloc queue at
        this step's pass, or ends at once (bad input)."""
        live = self.register(cmd)
        vocab = self.vocab_size
        bad = [t for t in cmd.input_ids if not 0 <= t < vocab] if vocab is not None else []
        if bad or not cmd.input_ids:
            # the API checks this too; the engine never trusts its caller with the device
            why = f"token ids outside [0, {vocab}): {bad[:5]}" if bad else "empty prompt"
            self.end(live, "bad_request", why, now)
            return
        host, port = cmd.bootstrap_host, cmd.bootstrap_port
        if live.has_peer and (not host or port is None or not 0 < port < 65536):
            self.end(live, "bad_request", f"bad prefill peer address {host!r}:{port} "
                     "(bootstrap_host, bootstrap_port)", now)
            return
        if live.has_peer:  # queued once its peer's protocol is known (this step's poll)
            self.wait_for_peer(live, now)
        else:
            self.arrivals.append(live)

    def _admit(self, now: float) -> None:
        """The prealloc queue's pass over this step's arrivals and those waiting: admitted
        requests fetch their KV, the rest end; then the drain deadline."""
        expire = now >= self._next_expire  # deadlines are seconds: not every step
        if expire:
            self._next_expire = now + _EXPIRE_EVERY_S
        arrivals, self.arrivals = self.arrivals, []
        decisions: list[Decision] = self.queue.pop_admitted(
            now, [lv.req for lv in arrivals if lv.ended is None], expire=expire)
        for d in decisions:
            if isinstance(d, Abort):
                self.end_decided(d, now)
                continue
            live = self.lives[d.req.rid]
            if self.host_tier is not None and not self._restore(live, d, now):
                continue
            try:
                self.fetch(live, d, now)
            except DecodeWorkerError as exc:  # this request's inputs, not the engine
                log.warning("rid=%s failed to start: %s", live.rid, exc)
                self.end(live, "bad_request", str(exc), now, failed=True)
        if self._drain_deadline is not None and now >= self._drain_deadline:
            for live in list(self.lives.values()):
                self.end(live, "drain", "aborted: drain", now)

    def _restore(self, live: LiveRequest, d: Admit, now: float) -> bool:
        """Start restoring `d`'s host hits into its pages (after any write still reading the
        pages admission gave it, e.g. those of a node it evicted: a transfer posted next must
        not land in pages a write still reads). The request keeps the handle and becomes
        READY once it is done (RESTORE). False when the restore failed and the request ended
        (every page returned, the host lock dropped)."""
        ht = self.host_tier
        assert ht is not None
        ht.pool.sync_writes_reading(d.full_page_ids)
        if d.restore is None:
            return True
        try:
            live.restore = ht.start_restore(d.restore)
        except RestoreFailed as exc:
            log.warning("rid=%s restore failed: %s", live.rid, exc)
            self.end(live, "restore_failed", f"host tier restore failed: {exc}", now,
                     failed=True)
            return False
        return True

    def register(self, cmd: AddRequest) -> LiveRequest:
        """A new request (QUEUED, not yet in the prealloc queue or parked)."""
        req = DecodeRequest(cmd.rid, cmd.bootstrap_room or 0, list(cmd.input_ids),
                            cmd.sampling.max_new_tokens)
        live = LiveRequest(req, cmd, self.eos_ids)
        self.lives[cmd.rid] = live
        return live

    def holders(self) -> list[DecodeRequest]:
        """Every request that may hold pages: the live ones and the ended ones still parked."""
        return ([lv.req for lv in self.lives.values()]
                + [rec.live.req for rec in self.parked.ended()])

    @property
    def num_fetching(self) -> int:
        """Live requests still getting their KV: transfers in flight (and ended ones whose
        transfer has not stopped) or waiting for landing room, and those waiting for their
        restore."""
        lot = self.parked
        return (lot.count(Wait.TRANSFER) + lot.count(Wait.LANDING)
                + lot.count(Wait.RESTORE, ended=False))

    # -- where a request goes next -------------------------------------------------------------
    def fetch(self, live: LiveRequest, admit: Admit, now: float) -> None:
        """`live` holds its pages (RESERVED): ask its prefill peer for the missing KV, or
        compute it here when the client named no peer (or it is a resumed request). Raises
        DecodeWorkerError for inputs the receiver refuses (nothing posted)."""
        req, fetcher = live.req, self.fetcher
        if admit.prefix_len >= live.cached_tokens:  # a readmission reports its best reuse
            live.cached_tokens = admit.prefix_len
            live.host_cached_tokens = admit.host_hit_len(self.kv_ctx.page_size)
        if live.has_peer and not req.is_resumed:
            self._post(live, admit, now)
            return
        prefix_len = admit.prefix_len
        self._when_restored(live, lambda t: fetcher.prefill_here(live, prefix_len, t), now)

    # -- the one poll --------------------------------------------------------------------------
    def poll(self, now: float) -> None:
        """Move on every parked request whose wait is over: transfers that reported, landing
        room that came free, restores that are done, peers whose protocol is known, launched
        steps that were waited for."""
        lot = self.parked
        for event in self.fetcher.events():
            rec = lot.of_transfer(event.transfer_id)
            if rec is not None:
                self._transfer_event(rec, event, now)
        for rec in lot.at(Wait.LANDING):  # in arrival order, after the transfers freed room
            if not self._post_landing(rec, now):
                break
        for rec in lot.at(Wait.RESTORE):
            if not rec.live.is_restoring:
                self._restored(rec, now)
        for rec in lot.at(Wait.PEER):
            self._resolve(rec, now)
        if lot.has(Wait.STEPS):
            done = self.running.steps_done
            for rec in lot.at(Wait.STEPS):
                if rec.until_step <= done:
                    self._settle(rec, now)

    def _restored(self, rec: Parked, now: float) -> None:
        """`rec`'s restore is done: a live request becomes READY, an ended one's pages go."""
        live = rec.live
        live.restore = None
        if rec.status is not None:
            self._settle(rec, now)
            return
        assert rec.then is not None
        rec.then(now)
        self.parked.move(rec, Wait.START)

    def _settle(self, rec: Parked, now: float) -> None:
        """An ended request's wait is over: nothing writes its pages any more."""
        assert rec.status is not None
        self.parked.move(rec, None)
        self._release(rec.live, rec.status, now)

    def _when_restored(self, live: LiveRequest, make_ready: Callable[[float], None],
                       now: float) -> None:
        """READY now (`make_ready`) if `live` has no restore in flight, else once it is done."""
        if live.is_restoring:
            self.parked.park(live, Wait.RESTORE, then=make_ready)
            return
        live.restore = None
        make_ready(now)
        self.parked.park(live, Wait.START)

    # -- the one exit --------------------------------------------------------------------------
    def end(self, live: LiveRequest, reason: str, message: str, now: float, *,
            matched_stop: int | None = None, failed: bool = False) -> None:
        """End `live` for `reason` ("stop" / "length": finished; else an abort label, or a
        failure when `failed`). Idempotent: a request ends once."""
        if live.ended is not None:
            return
        live.ended = live.ended_event(reason, message, matched_stop)
        self.lives.pop(live.rid, None)
        in_flight = self.running.leave(live)
        status = "finished" if reason in FINISH_REASONS else "failed" if failed else "aborted"
        self._count(live.req, status, reason)
        self.outbox.put(live.ended)
        if self.on_end is not None:
            self.on_end(live.rid, status)
        self._tell_peer(live, reason, message)
        rec, lot = live.parked, self.parked
        if rec is not None and rec.wait is Wait.LANDING:  # no transfer was posted
            lot.move(rec, None)
            rec = None
        if rec is not None and (rec.wait is Wait.TRANSFER or live.is_restoring):
            lot.end(rec, status)  # something may still write its pages: they wait for it
            if live.transfer_id is not None:
                self.transfers.abort_transfer(live.transfer_id)
            return
        if rec is not None:  # PEER, START, a restore already done: nothing writes its pages
            lot.move(rec, None)
        elif live.is_restoring:  # admitted, its restore started, it never got further
            lot.park(live, Wait.RESTORE, status=status)
            return
        elif in_flight:  # a launched step still reads and writes its pages on the device
            if status != "failed":  # its valid KV enters the tree now, before its answer
                self.decode_alloc.cache_computed(live.req)
            lot.park(live, Wait.STEPS, status=status,
                     until_step=self.running.steps_done + in_flight)
            return
        self._release(live, status, now)

    def end_decided(self, ab: Abort, now: float) -> None:
        """Admission aborted `ab.req` (already ABORTED, its pages returned and counted). The
        KV backstop (`kv_timeout`) may abort a request whose restore is still in flight: its
        pages are already free, so this waits for the copy before any page is handed out again
        (the compute thread allocates nothing meanwhile; a copy that late means a sick device)."""
        live = self.lives.get(ab.req.rid)
        if live is None:
            return
        if live.is_restoring:
            assert live.restore is not None
            log.warning("rid=%s aborted (%s) with its restore in flight: waiting for the copy",
                        live.rid, ab.reason)
            live.restore.wait()
        self.end(live, ab.reason, ab.message, now)

    def settle_all(self, now: float) -> None:
        """Shutdown (the device runs nothing else): release every ended request that waits for
        launched steps, and those waiting for a restore once it is done."""
        for rec in self.parked.at(Wait.STEPS):
            self._settle(rec, now)
        for rec in self.parked.at(Wait.RESTORE):
            if rec.status is not None:
                if rec.live.restore is not None:
                    rec.live.restore.wait()
                self._settle(rec, now)

    # -- internals -----------------------------------------------------------------------------
    def _count(self, req: DecodeRequest, status: str, reason: str) -> None:
        self.requests_total[status] += 1
        decided_by_admission = req.state is RequestState.ABORTED  # admission aborts first
        if status == "aborted" and not decided_by_admission:
            self.aborts_total[reason] += 1
        if status != "finished":
            log.info("rid=%s ended (%s): %s", req.rid, reason, req.message or status)

    def _release(self, live: LiveRequest, status: str, now: float) -> None:
        """`live`'s core request ends (FINISHED when it ran, else ABORTED or FAILED) and gives
        back what it holds; one still in the prealloc queue leaves it."""
        req, ended = live.req, live.ended
        assert ended is not None
        S = RequestState
        if req.state is S.QUEUED and self.queue.abort_request(req.rid, now, ended.reason,
                                                               ended.message):
            return
        if req.state in TERMINAL:  # admission aborted it and returned its pages itself
            return
        to = (S.FINISHED if req.state is S.RUNNING and status == "finished"
              else S.FAILED if status == "failed" else S.ABORTED)
        req.transition(to, now, keeper=self.kv_ctx, reason=ended.reason, message=ended.message)
