"""The request table: every request the engine knows, and the one exit every request leaves by.

A request enters with `add` and leaves through `end`, whatever ends it: it finished (stop token,
EOS, length, a stop string), the client left, admission or a deadline aborted it, its transfer
failed, the worker drains or shuts down. `end` answers the client once (`Ended`), counts the end,
and releases exactly what the request held:

```
state at end         released by end
QUEUED               its place in the prealloc queue (it holds no pages)
transfer in flight   nothing yet: the peer may still write into its pages; the receiver is
                     told to stop, and `transfer_over` releases them once it has
restore in flight    nothing yet: the host tier's copy may still write into its pages;
                     `restores_done` releases them once the copy is done
RESERVED..RUNNING    its pages and prefix lock (valid KV stays cached in the tree)
RUNNING, a launched  its valid KV enters the tree at once (so the step's KV events, published
step still using it  before its answer leaves, name it); its pages and lock wait in `settling`
                     until the stepper has waited for that step
already terminal     nothing (admission aborted it and returned its pages itself)
```
Compute thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from decode_worker.core.admission import Abort, PreallocQueue
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.kv_context import KVContext
from decode_worker.core.request import TERMINAL, DecodeRequest, RequestState
from decode_worker.daemon.decode.batch import RunningBatch
from decode_worker.daemon.decode.bridge import AddRequest, Outbox, RefuseRequest
from decode_worker.daemon.decode.live import LiveRequest

log = logging.getLogger(__name__)
S = RequestState
FINISHED = frozenset({"stop", "length"})  # end reasons of a request that finished normally


class TransferStopper(Protocol):
    """What the table needs of the KV receiver: stop one transfer (its pages come back with the
    receiver's "released" or "done" event); tell a prefill peer that a room's request ended."""

    def abort(self, transfer_id: int) -> None: ...

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None: ...


class RequestTable:
    """The live requests by rid, the running batch, and the ended requests whose pages a
    transfer still holds (see the module docstring).

    `counts`: requests ended by status, and aborts by reason for those the shell decided
    (admission counts its own in `SchedulerStats`); the books export both.
    """

    def __init__(self, kv_ctx: KVContext, queue: PreallocQueue, decode_alloc: DecodeAllocator,
                 transfers: TransferStopper, outbox: Outbox, running: RunningBatch) -> None:
        self.kv_ctx, self.queue, self.decode_alloc = kv_ctx, queue, decode_alloc
        self.transfers = transfers
        self.outbox = outbox
        self.lives: dict[str, LiveRequest] = {}
        self.running = running  # the decode batch (the stepper joins it; `end` leaves it)
        self._ready: list[LiveRequest] = []  # arrived (READY), not yet started
        # transfer id -> an ended request whose pages the transfer still holds, and its status
        self.draining: dict[int, tuple[LiveRequest, str]] = {}
        # ended requests whose pages a host-tier restore still writes: (request, status)
        self.restoring: list[tuple[LiveRequest, str]] = []
        # ended requests whose pages launched steps still use: (request, status, steps left)
        self.settling: list[tuple[LiveRequest, str, int]] = []
        self.requests_total: Counter[str] = Counter()  # finished / aborted / failed
        self.aborts_total: Counter[str] = Counter()  # shell-decided aborts, by reason

    def add(self, cmd: AddRequest, eos_ids: frozenset[int], now: float) -> LiveRequest:
        """Register a new request (QUEUED, not yet in the prealloc queue)."""
        req = DecodeRequest(cmd.rid, cmd.bootstrap_room or 0, list(cmd.input_ids),
                            cmd.sampling.max_new_tokens)
        live = LiveRequest(req, cmd, eos_ids)
        self.lives[cmd.rid] = live
        return live

    def holders(self) -> list[DecodeRequest]:
        """Every request that may hold pages: the live ones and those a transfer still holds."""
        return ([lv.req for lv in self.lives.values()]
                + [lv.req for lv, _ in self.draining.values()]
                + [lv.req for lv, _ in self.restoring]
                + [lv.req for lv, _, _ in self.settling])

    def arrived(self, live: LiveRequest) -> None:
        """`live`'s KV and first token arrived (READY): it joins the batch at the next step."""
        self._ready.append(live)

    def ready(self) -> list[LiveRequest]:
        """The requests that arrived since the last call and are still READY, in arrival order
        (not a scan of every request: the batch may be hundreds)."""
        out, self._ready = self._ready, []
        return [lv for lv in out if lv.req.state is S.READY]

    # -- the one exit ----------------------------------------------------------------------------
    def end(self, live: LiveRequest, reason: str, message: str, now: float, *,
            matched_stop: int | None = None, failed: bool = False) -> None:
        """End `live` for `reason` ("stop" / "length": finished; else an abort label, or a
        failure when `failed`). Idempotent: a request ends once."""
        if live.ended is not None:
            return
        live.ended = live.ended_event(reason, message, matched_stop)
        self.lives.pop(live.rid, None)
        in_flight = self.running.leave(live)
        status = "finished" if reason in FINISHED else "failed" if failed else "aborted"
        self._count(live.req, status, reason)
        self.outbox.put(live.ended)
        self._tell_peer(live, reason, message)
        if live.transfer_id is not None:  # the peer may still be writing: wait for it
            self.draining[live.transfer_id] = (live, status)
            self.transfers.abort(live.transfer_id)
            return
        if live.is_restoring:  # the restore stream still writes its pages: wait for it
            self.restoring.append((live, status))
            return
        if in_flight:  # a launched step still reads and writes its pages on the device
            if status != "failed":  # its valid KV enters the tree now, before its answer
                self.decode_alloc.cache_computed(live.req)
            self.settling.append((live, status, in_flight))
            return
        self._release(live, status, now)

    def step_done(self, now: float) -> None:
        """The stepper waited for one more launched step: release the pages of the ended
        requests no launched step uses any more. Until then a page of theirs is not handed out
        again (a new request's KV transfer must not land in a page a step still writes)."""
        if not self.settling:
            return
        waiting = []
        for live, status, steps in self.settling:
            if steps > 1:
                waiting.append((live, status, steps - 1))
            else:
                self._release(live, status, now)
        self.settling = waiting

    def restores_done(self, now: float) -> None:
        """Release the pages of the ended requests whose restore is done (polled each step)."""
        if not self.restoring:
            return
        still = []
        for live, status in self.restoring:
            if live.is_restoring:
                still.append((live, status))
            else:
                self._release(live, status, now)
        self.restoring = still

    def settle_all(self, now: float) -> None:
        """Release every settling request, and those waiting for a restore once it is done
        (shutdown: the device runs nothing else)."""
        while self.settling:
            self.step_done(now)
        for live, _ in self.restoring:
            if live.restore is not None:
                live.restore.wait()
        self.restores_done(now)

    def refuse(self, cmd: RefuseRequest) -> None:
        """Requests the worker refused before they reached the engine (at the HTTP door: queue
        full, too long, draining, a bad request, ...): counted as aborted for `cmd.reason`, and
        each room is ended at its prefill peer as `end` ends a request's (`_tell_peer`)."""
        self.requests_total["aborted"] += cmd.num_requests
        self.aborts_total[cmd.reason] += cmd.num_requests
        log.info("refused %d request(s) (%s): %s", cmd.num_requests, cmd.reason, cmd.message)
        for host, port, room in cmd.rooms:
            self._cancel_room(host, port, room, cmd.reason, cmd.message)

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

    def transfer_over(self, transfer_id: int, now: float) -> bool:
        """The transfer `transfer_id` stopped (released, or done after all): if it belonged to
        an ended request, release that request's pages now and return True."""
        entry = self.draining.pop(transfer_id, None)
        if entry is None:
            return False
        live, status = entry
        live.transfer_id = None
        if live.is_restoring:
            self.restoring.append((live, status))
        else:
            self._release(live, status, now)
        return True

    # -- internals ------------------------------------------------------------------------------
    def _tell_peer(self, live: LiveRequest, reason: str, message: str) -> None:
        """A request that ends before its KV arrived (refused at admission, client abort, drain,
        a failed transfer) ends at its prefill peer too, which then answers the router's copy of
        the request with `reason` at once instead of at its own timeout. Sent for a peer found
        dead or unreachable too: one that restarts (or wakes from a stall) within seconds may
        still get the router's copy of the request, and must not hold it to its timeout. Not
        sent once the first token came (the peer answered already)."""
        cmd = live.cmd
        if live.req.output_ids or reason in FINISHED:
            return
        self._cancel_room(cmd.bootstrap_host, cmd.bootstrap_port or 0, cmd.bootstrap_room,
                          reason, message)

    def _cancel_room(self, host: str | None, port: int, room: int | None, reason: str,
                     message: str) -> None:
        """End `room` at the prefill peer host:port (in its protocol: the receiver's
        `cancel_room`), if the address and room are whole."""
        if host and room is not None and 0 < port < 65536:
            self.transfers.cancel_room(host, port, room, reason, message)

    def _count(self, req: DecodeRequest, status: str, reason: str) -> None:
        self.requests_total[status] += 1
        decided_by_admission = req.state is S.ABORTED  # admission aborts before the shell hears
        if status == "aborted" and not decided_by_admission:
            self.aborts_total[reason] += 1
        if status != "finished":
            log.info("rid=%s ended (%s): %s", req.rid, reason, req.message or status)

    def _release(self, live: LiveRequest, status: str, now: float) -> None:
        req, ended = live.req, live.ended
        assert ended is not None
        if req.state is S.QUEUED:
            self.queue.abort(req.rid, now, ended.reason, ended.message)
        elif req.state is S.RUNNING and status == "finished":
            self.decode_alloc.finish(req, now)
        elif req.state not in TERMINAL:
            to = S.FAILED if status == "failed" else S.ABORTED
            req.transition(to, now, releaser=self.kv_ctx, reason=ended.reason,
                           message=ended.message)
