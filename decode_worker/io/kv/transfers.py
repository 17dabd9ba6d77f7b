"""The receiver's per-transfer book: the transfers in flight, their deadlines and quiesce, the
events for the owner, and the stats.

`TransferBook` knows no socket and no NIXL agent: `KVReceiver` feeds it what arrived (a peer's
answer, a notification, the clock) and gives it `send_abort`, the one way back to a peer. Every
transfer leaves the book through exactly one of `complete` ("done") or `release` ("released").
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from decode_worker.io.kv.peer import ReceiverStats, Transfer, TransferEvent, transfer_bytes
from decode_worker.io.kv.protocol import Notif, RegionLayout, TransferDone, TransferRequest

log = logging.getLogger(__name__)

MAX_FINISHED = 4096  # recent transfer ids kept to tell a late notification from an unknown one


class TransferBook:
    """The transfers of one receiver, by id. Owner thread only (the receiver's).

    `regions` size a "done" transfer's bytes; `abort_quiesce_s` is how long a failed or aborted
    transfer's pages wait for the peer to stop writing; `send_abort(xfer)` asks its peer to stop
    (best effort: the quiesce deadline protects the pages anyway). `stats` counts every "done"
    (bytes, tokens, duration and descriptors), every failure by reason, and every release by
    the quiesce clock.
    """

    def __init__(
        self,
        regions: dict[str, RegionLayout],
        abort_quiesce_s: float,
        send_abort: Callable[[Transfer], None],
        protocol: str = "native",
        size_of: Callable[[TransferRequest], int] | None = None,
        checksum_of: Callable[[TransferRequest], int] | None = None,
    ) -> None:
        """`protocol` labels every event; `size_of(req)` is the bytes a "done" transfer moved
        (default: `transfer_bytes` over `regions`); `checksum_of(req)`: the checksum of what
        landed, checked against the peer's for a request with `kv_checksum`."""
        self._checksum_of = checksum_of
        self.regions, self.abort_quiesce_s = regions, abort_quiesce_s
        self._send_abort = send_abort
        self.protocol = protocol
        self._size_of = size_of or (lambda req: transfer_bytes(req, regions))
        self._transfers: dict[int, Transfer] = {}
        self._finished: OrderedDict[int, None] = OrderedDict()  # recent ids, for late notifs
        self._events: list[TransferEvent] = []
        # rooms whose peer stopped on its own word lately (failed, or acked an abort): told
        # nothing more (a peer keeps the cause it found itself)
        self._peer_settled: OrderedDict[int, None] = OrderedDict()
        self.stats = ReceiverStats()

    def add(self, req: TransferRequest, peer_key: str, now: float) -> Transfer:
        """Record a new transfer ("queued") with its deadline `now + req.deadline_s`."""
        xfer = Transfer(req, peer_key, now, now + req.deadline_s)
        self._transfers[req.transfer_id] = xfer
        return xfer

    def get(self, transfer_id: int) -> Transfer | None:
        return self._transfers.get(transfer_id)

    def of_peer(self, peer_key: str) -> list[Transfer]:
        return [x for x in self._transfers.values() if x.peer_key == peer_key]

    def __len__(self) -> int:
        return len(self._transfers)

    def take_events(self) -> list[TransferEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def on_notif(self, notif: Notif, sender: str, now: float) -> None:
        """One WRITE's notification; the transfer completes once every part has landed."""
        xfer = self._transfers.get(notif.transfer_id)
        if xfer is None or xfer.req.room != notif.room:
            late = notif.transfer_id in self._finished
            self.stats.late_notifs += late
            self.stats.unknown_notifs += not late
            log.info("%s notification %s from %s", "late" if late else "unknown", notif, sender)
            return
        if xfer.add_part(notif):
            xfer.landed = True
            self._settle(xfer, now)

    def on_peer_done(self, done: TransferDone, now: float) -> None:
        """The peer's TransferDone: its WRITEs are over (an aborting transfer is quiet) and it
        carries the checksum a `kv_checksum` request waits for."""
        xfer = self._transfers.get(done.transfer_id)
        if xfer is None:
            return
        if xfer.phase == "aborting":
            self.release(xfer, now)
            return
        xfer.peer_done = done
        if xfer.landed:
            self._settle(xfer, now)

    def _settle(self, xfer: Transfer, now: float) -> None:
        """Every part landed: "done", unless the request asked for a checksum (then only once
        the peer's checksum came, and only if it matches what landed; else `kv_checksum`)."""
        if not xfer.req.kv_checksum or xfer.phase == "aborting" or self._checksum_of is None:
            self.complete(xfer, now)
            return
        if xfer.peer_done is None:
            return  # wait for the peer's TransferDone (the transfer deadline still runs)
        theirs, ours = xfer.peer_done.kv_checksum, self._checksum_of(xfer.req)
        if theirs == ours:
            self.complete(xfer, now)
            return
        self.stats.kv_checksum_failures += 1
        self.fail(xfer, "kv_checksum", f"KV checksum mismatch: peer {theirs:#x}, landed {ours:#x}"
                  if theirs is not None else "the peer sent no KV checksum", now, acked=True)

    def on_peer_failed(self, tid: int, reason: str, now: float) -> None:
        """The peer reported `TransferFailed`: it stopped, so the pages are quiet either way."""
        xfer = self._transfers.get(tid)
        if xfer is not None:
            self._note_peer_settled(xfer.req.room)
        if xfer is not None and xfer.phase == "aborting":
            self.release(xfer, now)  # it stopped: the pages are quiet
        elif xfer is not None:
            self.fail(xfer, "transfer_failed", f"peer: {reason}", now, acked=True)

    def on_peer_stopped(self, tid: int, now: float) -> None:
        """The peer acked an abort or finished: an aborting transfer's pages are quiet."""
        xfer = self._transfers.get(tid)
        if xfer is not None and xfer.phase == "aborting":
            self._note_peer_settled(xfer.req.room)
            self.release(xfer, now)

    def is_peer_settled(self, room: int) -> bool:
        """True if `room`'s peer reported failing it, or acked its abort, lately: a later
        cancel of the room would only overwrite the cause the peer recorded."""
        return room in self._peer_settled

    def _note_peer_settled(self, room: int) -> None:
        self._peer_settled[room] = None
        while len(self._peer_settled) > MAX_FINISHED:
            self._peer_settled.popitem(last=False)

    def check_deadlines(self, now: float) -> None:
        """Release the aborting transfers past their quiesce; fail the others past deadline."""
        for xfer in list(self._transfers.values()):
            if xfer.phase == "aborting":
                if now >= xfer.release_at:
                    self.stats.quiesce_expired += 1
                    r = xfer.req
                    log.warning("transfer %d rid=%s room=%d: no word from the peer within "
                                "%.1f s of the abort; releasing its pages", r.transfer_id, r.rid,
                                r.room, self.abort_quiesce_s)  # fmt: skip
                    self.release(xfer, now)
            elif now >= xfer.deadline:
                detail = f"KV did not arrive within {xfer.req.deadline_s:.1f} s"
                self.fail(xfer, "kv_timeout", detail, now)

    def fail(
        self, xfer: Transfer, reason: str, detail: str, now: float, acked: bool = False
    ) -> None:
        """Fail one transfer. Unless the peer cannot be writing (`acked`, or never asked), its
        pages wait for an ack, the last notification, or `abort_quiesce_s`."""
        r = xfer.req
        log.warning("transfer %d rid=%s room=%d failed (%s): %s", r.transfer_id, r.rid, r.room,
                    reason, detail)  # fmt: skip
        self.stats.failures[reason] += 1
        self._events.append(TransferEvent("failed", r.transfer_id, r.rid, r.room, reason, detail,
                                          protocol=self.protocol))
        if acked or xfer.phase == "queued":
            self.release(xfer, now)
        else:
            self.start_abort(xfer, now)

    def abort(self, transfer_id: int, now: float) -> None:
        """The owner stops waiting for a transfer: a queued one (nothing asked of the peer) is
        released at once, one in flight waits for the peer (`start_abort`); unknown or already
        aborting: nothing."""
        xfer = self._transfers.get(transfer_id)
        if xfer is None or xfer.phase == "aborting":
            return
        if xfer.phase == "queued":
            self.release(xfer, now)
        else:
            self.start_abort(xfer, now)

    def start_abort(self, xfer: Transfer, now: float) -> None:
        """Hold the pages until the peer stops or `abort_quiesce_s` passes; ask it to stop."""
        xfer.phase, xfer.release_at = "aborting", now + self.abort_quiesce_s
        self._send_abort(xfer)

    def release(self, xfer: Transfer, now: float) -> None:
        """The transfer's pages are the owner's again ("released")."""
        self._forget(xfer)
        r = xfer.req
        self._events.append(TransferEvent("released", r.transfer_id, r.rid, r.room,
                                          protocol=self.protocol))

    def complete(self, xfer: Transfer, now: float) -> None:
        """Everything of the transfer landed: "done" (or "released" if it was aborting: the
        peer finished writing, so the pages are quiet)."""
        if xfer.phase == "aborting":
            self.release(xfer, now)
            return
        self._forget(xfer)
        r = xfer.req
        ev = TransferEvent(
            "done", r.transfer_id, r.rid, r.room, num_bytes=self._size_of(r),
            num_descriptors=xfer.num_descriptors, num_tokens=r.prompt_len - r.reused_len,
            duration_s=now - xfer.started_at, protocol=self.protocol,
        )  # fmt: skip
        self.stats.count_done(ev.num_bytes, ev.num_tokens, ev.duration_s, ev.num_descriptors)
        self._events.append(ev)

    def _forget(self, xfer: Transfer) -> None:
        self._transfers.pop(xfer.req.transfer_id, None)
        self._finished[xfer.req.transfer_id] = None
        while len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)
