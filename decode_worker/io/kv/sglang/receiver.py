"""Decode side of SGLang 0.5.23's PD transfer (NIXL backend): `SglangReceiver`.

Same owner contract as `KVReceiver` (peer.TransferReceiver): single owner thread,
`take_events()` never blocks (HTTP runs in a small thread pool, polled through futures). Per
transfer:

    submit ──► "done"                  KV_STATUS Success from every prefill TP rank; the owner
           │                           then checks the aux row's bootstrap_room itself
           └─► "failed" ... "released" released once every rank settled (KV_STATUS or
                                       ABORT_ACK) or after `abort_quiesce_s` (counted)
    abort_transfer ──► "released"      ABORT(room, ip, port, generation) to each rank that
                                       has not reported yet (one that did keeps its cause)

Failure reasons: transfer_failed (KV_STATUS Failed, detail = the prefill's reason; a prefill
this worker refuses: page size, KV dtype, layout, parallelism; not an SGLang bootstrap server;
a send error), peer_dead (bootstrap server refused or silent on /health for
`peer_dead_after_s`, or a rank's connection dropped: the peer is forgotten, put in
`lost_peers`, and the next submit registers again), kv_timeout, bad_request (page ids, window
start or aux row that do not fit, or a room already in flight). Peers: peer_set.py; pages as
SGLang sees them: layout.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import zmq

from decode_worker.core.types import MemoryRegion
from decode_worker.errors import PageError, TransferError
from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.nixl_agent import NixlAgent
from decode_worker.io.kv.peer import Transfer, TransferEvent
from decode_worker.io.kv.receiver_base import ReceiverBase
from decode_worker.io.kv.sglang import frames as f
from decode_worker.io.kv.sglang import messages as m
from decode_worker.io.kv.sglang.layout import SglangLayout
from decode_worker.io.kv.sglang.links import StatusInbox
from decode_worker.io.kv.sglang.peer_set import PeerLost, SglangPeers
from decode_worker.io.kv.sglang.peers import RoomIndex, SglangPeer, SglangTransfer
from decode_worker.io.kv.sglang.requests import registration, translate
from decode_worker.io.kv.transfers import TransferBook

if TYPE_CHECKING:
    from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)

AuxRegion = tuple[int, int, int]  # (addr, row_bytes, num_rows) of one SGLang aux buffer


class SglangReceiver(ReceiverBase[SglangPeer]):
    """Receives KV written by SGLang prefill instances into our pools (see module doc).

    `regions`: our "full" and "swa" RegionLayouts (an "aux" entry is ignored), and a "landing"
    one for a model SGLang lays out with full KV in every layer (layout.py); `aux_buffers`:
    SGLang's 10 aux buffers in its order, allocated in host memory, registered here. `agent`:
    a NixlAgent shared with the native receiver (its owner registered the pools and closes
    it); without one this receiver builds its own and registers the pools too. `zmq_ports` =
    (lo, hi) confines our status socket's port. Raises ConfigError if the agent cannot start
    or register.
    """

    def __init__(
        self, settings: TransferSettings, compat: p.ModelCompat,
        regions: dict[str, p.RegionLayout], aux_buffers: Sequence[AuxRegion], *,
        agent: NixlAgent | None = None, kv_timeout_s: float = 30.0, agent_name: str | None = None,
        zmq_ports: tuple[int, int] | None = None, http_timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        self.compat = compat
        self.regions = {k: v for k, v in regions.items() if k in ("full", "swa", "landing")}
        self.aux_buffers = list(aux_buffers)
        super().__init__(settings, self.regions, kv_timeout_s, agent, agent_name)
        self.agent.register([MemoryRegion(a, rb * n, 0, "DRAM") for a, rb, n in self.aux_buffers])
        http_timeout_s = http_timeout_s or max(0.2, min(2.0, settings.peer_dead_after_s / 2))
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._inbox = StatusInbox(self._ctx, zmq_ports)
        self._peers = SglangPeers(settings, compat, self.regions, self._ctx, self._inbox,
                                  self._registration_of, http_timeout_s)  # fmt: skip
        self._xfers: dict[int, SglangTransfer] = {}
        self._book = TransferBook(self.regions, settings.abort_quiesce_s, self._send_abort,
                                  protocol="sglang",
                                  size_of=lambda req: self._xfers[req.transfer_id].num_bytes)
        self._rooms = RoomIndex()
        self._generation = 0
        self.lost_peers = self._peers.lost  # dropped as dead, for the router to probe again
        self.stats = self._book.stats

    # -- owner API (`submit`, `abort_transfer`: ReceiverBase) ------------------------------

    def _peer_for(self, xfer: Transfer, host: str, port: int, now: float) -> SglangPeer | None:
        tid, room = xfer.req.transfer_id, xfer.req.room
        self._xfers[tid] = SglangTransfer()
        if not self._rooms.add(room, tid):
            self._book.fail(xfer, "bad_request", f"room {room} is already in flight", now)
            return None
        return self._peers.get_or_add(xfer.peer_key, host, port, now)

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None:
        """`ABORT room` (no ip/port: no ack) to the ranks holding `room` that have not reported
        on it, once the peer is ready. SGLang's ABORT has no reason field: the prefill answers
        its client without `reason`.

        A rank that reported (a final KV_STATUS or an ABORT_ACK) gets no ABORT: SGLang records
        an ABORT's "decode-side abort" as the room's cause over its own (a failure it found
        itself). The status messages already received are read first, so one that came before
        the request ended counts. A room whose TransferInfo went out is left to the transfer's
        own abort (`abort_transfer`), which ABORTs exactly its unsettled ranks."""
        now = time.monotonic()
        self._read_inbox(now)
        xfer = self._book.get(self._rooms.get(room))
        if xfer is not None and xfer.phase != "queued":
            return
        peer = self._peers.get_or_add(f"{host}:{port}", host, port, now)
        if peer.ready and peer.links is not None:
            settled = self._settled_ranks(room)
            for rank in peer.ranks_of(room):
                if rank[1] not in settled:
                    with contextlib.suppress(TransferError):
                        peer.links.send(rank, m.encode_abort(f.Abort(room)))
        else:
            peer.cancels.append((room, reason, detail))

    def _settled_ranks(self, room: int) -> frozenset[int]:
        """The tp ranks that reported on `room`'s latest transfer (in the book, or lately
        finished); none for a room this receiver never asked for."""
        sg = self._xfers.get(self._rooms.get(room))
        return frozenset(sg.settled) if sg is not None else self._rooms.settled_after(room)

    def take_events(self) -> list[TransferEvent]:
        """Do all pending work without blocking; returns the events since the last call."""
        now = time.monotonic()
        for change in self._peers.advance(now, lambda tid: self._book.get(tid) is not None):
            if isinstance(change, PeerLost):
                self._on_lost(change, now)
            else:
                self._on_ready(change, now)
        self._read_inbox(now)
        self._book.check_deadlines(now)
        events = self._book.take_events()
        for ev in events:
            if ev.kind != "failed":
                sg = self._xfers.pop(ev.transfer_id, None)
                settled = frozenset(sg.settled) if sg is not None else frozenset()
                self._rooms.remove(ev.room, ev.transfer_id, settled)
        return events

    def _read_inbox(self, now: float) -> None:
        """Account every KV_STATUS / ABORT_ACK received so far (events: `take_events`): all of
        them first, then each transfer they touched settles once. A failure and another rank's
        report in the same read: the ABORT that failure sends skips both reporting ranks."""
        touched: dict[int, tuple[Transfer, SglangTransfer]] = {}
        for msg in self._inbox.recv_all():
            if (hit := self._record(msg)) is not None:
                touched[hit[0].req.transfer_id] = hit
        self.stats.bad_frames += self._inbox.take_bad_frames()
        for xfer, sg in touched.values():
            self._settle(xfer, sg, now)

    def close(self) -> None:
        self._peers.close()
        self._inbox.close()
        self._ctx.term()
        if self._owns_agent:
            self.agent.close()

    # -- peers -----------------------------------------------------------------------------

    def _registration_of(self, layout: SglangLayout, ip: str, port: int) -> list[bytes]:
        return m.encode_registration(registration(
            layout, ip, port, self.agent.name, self.agent.metadata(),
            [addr for addr, _, _ in self.aux_buffers], self.regions["full"].device_id))

    def _on_ready(self, peer: SglangPeer, now: float) -> None:
        cancels, peer.cancels = peer.cancels, []
        for cancel in cancels:
            self.cancel_room(peer.host, peer.port, *cancel)
        self._send_waiting(peer, now)

    def _on_lost(self, lost: PeerLost, now: float) -> None:
        """Fail every transfer of a lost peer (an aborting one keeps its quiesce clock); ABORT
        cannot reach it any more, so the sent ones wait for `abort_quiesce_s`."""
        self._fail_peer(lost.peer.key, lost.reason, lost.detail, now)

    # -- transfers -------------------------------------------------------------------------

    def _send(self, peer: SglangPeer, xfer: Transfer, now: float) -> None:
        """One TransferInfo to every rank holding the room (the transfer becomes "sent")."""
        req, sg = xfer.req, self._xfers[xfer.req.transfer_id]
        assert peer.layout is not None and peer.links is not None  # ready
        try:
            info, sg.num_bytes = translate(peer.layout, self.compat.window, req,
                                           peer.our_ip, peer.our_port, self.agent.name,
                                           self.aux_buffers)  # fmt: skip
        except PageError as exc:
            self._book.fail(xfer, "bad_request", f"room {req.room}: {exc}", now)
            return
        sg.ranks, xfer.phase = peer.ranks_of(req.room), "sent"
        frames = m.encode_transfer_info(info)
        try:
            for rank in sg.ranks:
                peer.links.send(rank, frames)
        except TransferError as exc:
            self._book.fail(xfer, "transfer_failed", str(exc), now)

    def _record(self, msg: f.KVStatus | f.AbortAck) -> tuple[Transfer, SglangTransfer] | None:
        """Account one message on its transfer (not settled yet: `_read_inbox` does); None for
        a late, unknown or bad one (counted)."""
        tid = self._rooms.get(msg.room)
        xfer, sg = self._book.get(tid), self._xfers.get(tid)
        if xfer is None or sg is None or xfer.phase == "queued":
            late = self._rooms.was_finished(msg.room)
            self.stats.late_notifs += late
            self.stats.unknown_notifs += not late
            log.info("%s %s from an SGLang prefill", "late" if late else "unknown", msg)
        elif not sg.record(msg, aborting=xfer.phase == "aborting"):
            self.stats.bad_frames += 1
            log.warning("room %d: prefill rank %d is not one of its %d ranks", msg.room,
                        msg.prefill_rank, len(sg.ranks))  # fmt: skip
        else:
            return xfer, sg
        return None

    def _settle(self, xfer: Transfer, sg: SglangTransfer, now: float) -> None:
        if xfer.phase == "aborting":
            if sg.all_settled:
                self._book.release(xfer, now)
        elif sg.failure is not None:
            self._book.fail(xfer, "transfer_failed", f"prefill: {sg.failure}", now,
                            acked=sg.all_settled)  # fmt: skip
        elif sg.all_succeeded:
            self._book.complete(xfer, now)

    def _send_abort(self, xfer: Transfer) -> None:
        """ABORT to every rank of the transfer that has not reported yet (`TransferBook.
        start_abort` calls this; a rank that reported keeps its own cause); best effort: the
        quiesce deadline still protects the pages."""
        sg, peer = self._xfers.get(xfer.req.transfer_id), self._peers.peers.get(xfer.peer_key)
        if sg is None or peer is None or peer.links is None:
            return
        self._generation += 1
        sg.generation = self._generation
        frames = m.encode_abort(f.Abort(xfer.req.room, peer.our_ip, peer.our_port,
                                        sg.generation))  # fmt: skip
        for rank in sg.unsettled():
            with contextlib.suppress(TransferError):
                peer.links.send(rank, frames)
