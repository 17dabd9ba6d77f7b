"""Decode side of KV transfer: handshakes, transfer requests, completions, liveness.

`KVReceiver` is single-threaded and non-blocking: its owner (the compute thread) calls
`take_events()` at least every ~100 ms. Every failure fails only its own transfer. Per transfer
the owner gets:

    submit ──► "done"                       KV and first token landed; pages are the request's
           └─► "failed" ... "released"      tell the client now; reuse the pages only on
                                            "released" (the peer acked, finished, or
                                            `abort_quiesce_s` passed)
    abort_transfer ──► "released"           (no "failed": the owner asked for it)

Failure reasons are the abort labels of docs/CONTRACTS.md: transfer_failed (peer-reported
error, refused handshake, NIXL error), peer_dead (no heartbeat answer for `peer_dead_after_s`,
or the connection refused or closed: the peer is not there, or exited or restarted), kv_timeout
(the transfer's deadline passed), bad_request (invalid page ids), kv_checksum. A peer dropped
as dead goes in `lost_peers`; the next submit connects and handshakes anew.

The per-transfer book (deadlines, quiesce, events, stats) is `transfers.TransferBook`; this
module is the plumbing around it: the NIXL agent, the peers' ZMQ sockets, handshakes, heartbeats.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import zmq

from decode_worker.errors import PageError, TransferError
from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.kv_checksum import landed_checksum
from decode_worker.io.kv.nixl_agent import NixlAgent
from decode_worker.io.kv.peer import LostPeers, Peer, Transfer, TransferEvent
from decode_worker.io.kv.protocol_check import check_compat, validate_request
from decode_worker.io.kv.receiver_base import ReceiverBase
from decode_worker.io.kv.transfers import TransferBook

if TYPE_CHECKING:  # io/ takes the settings object but does not import pydantic at run time
    from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)

__all__ = ["KVReceiver", "TransferEvent"]


class KVReceiver(ReceiverBase[Peer]):
    """Receives KV pushed by prefill peers into the regions registered here.

    `regions` are the decode side's "full", "swa" and "aux" layouts (see protocol.RegionLayout;
    `daemon.shared.compat.region_layouts` builds them from KVPools + AuxBuffer). `kv_timeout_s`
    is the default per-transfer deadline (settings `scheduler.kv_timeout_s`). `stats` counts
    what happened (the daemon turns it into metrics). `agent`: a NixlAgent shared with another
    receiver (its owner registered `regions`, see `register_regions`, and closes it); without
    one this receiver builds its own. Raises ConfigError if the NIXL agent cannot start.
    """

    def __init__(
        self, settings: TransferSettings, compat: p.ModelCompat,
        regions: dict[str, p.RegionLayout], kv_timeout_s: float = 30.0,
        agent_name: str | None = None, agent: NixlAgent | None = None,
    ) -> None:  # fmt: skip
        super().__init__(settings, regions, kv_timeout_s, agent, agent_name)
        self.compat, self.regions = compat, regions
        self._hello = p.Hello(p.PROTOCOL_VERSION, compat, self.agent.name,
                              self.agent.metadata(), list(regions.values()))  # fmt: skip
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._peers: dict[str, Peer] = {}
        self._book = TransferBook(regions, settings.abort_quiesce_s, self._send_abort,
                                  checksum_of=landed_checksum(settings.kv_checksum, regions))
        self.lost_peers = LostPeers()  # dropped as dead, for the router (it probes them again)
        self.stats = self._book.stats

    # -- owner API (`submit`, `abort_transfer`: ReceiverBase) ------------------------------

    def _wire_extras(self, prompt_ids: list[int] | None) -> tuple[list[int] | None, bool]:
        return prompt_ids, self.settings.kv_checksum

    def _peer_for(self, xfer: Transfer, host: str, port: int, now: float) -> Peer | None:
        try:
            validate_request(xfer.req, self.compat.page_size, self.regions)
        except PageError as exc:
            self._book.fail(xfer, "bad_request", str(exc), now)
            return None
        try:
            return self._peers.get(xfer.peer_key) or self._connect(host, port, now)
        except TransferError as exc:
            self._book.fail(xfer, "bad_request", str(exc), now)
            return None

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None:
        """Tell the peer at host:port that this side ended `room`'s request (`reason`: its abort
        label) before its KV arrived: `Abort(0, room, reason)`, which needs no transfer and no
        handshake (a peer not connected yet is). Not sent for a room the peer failed (or
        stopped) itself: what it already received is read first, and it keeps its own cause.
        Best effort: never raises."""
        try:
            key, now = f"{host}:{port}", time.monotonic()
            if (known := self._peers.get(key)) is not None:
                self._read_peer(known, now)
            if self._book.is_peer_settled(room):
                log.debug("room %d: the peer ended it itself; no cancel (%s)", room, reason)
                return
            peer = self._peers.get(key) or self._connect(host, port, now)  # read may drop it
            peer.client.send(p.Abort(0, room, reason, detail[:512]))
        except TransferError as exc:
            log.info("room %d: cannot tell prefill peer %s:%s about %s: %s", room, host, port,
                     reason, exc)

    def take_events(self) -> list[TransferEvent]:
        """Do all pending work without blocking; returns the events since the last call."""
        now = time.monotonic()
        for peer in list(self._peers.values()):
            self._read_peer(peer, now)
        self._read_notifs(now)
        self._check_liveness(now)
        self._book.check_deadlines(now)
        return self._book.take_events()

    def close(self) -> None:
        for peer in self._peers.values():
            peer.client.close()
        self._peers.clear()
        if self._owns_agent:
            self.agent.close()
        self._ctx.term()

    # -- peers -----------------------------------------------------------------------------

    def _connect(self, host: str, port: int, now: float) -> Peer:
        peer = Peer.open(self._ctx, host, port, now, self.settings.heartbeat_interval_s)
        self._peers[peer.key] = peer
        peer.client.send(self._hello)
        return peer

    def _read_peer(self, peer: Peer, now: float) -> None:
        for msg in peer.client.recv_all():
            peer.heard()
            match msg:
                case p.Welcome():
                    self._on_welcome(peer, msg, now)
                case p.Refused(reason=reason):
                    self._drop_peer(peer, "transfer_failed", f"peer refused: {reason}", now)
                    return
                case p.TransferFailed(transfer_id=tid, reason=reason):
                    self._book.on_peer_failed(tid, reason, now)
                case p.TransferDone():
                    self._book.on_peer_done(msg, now)
                case p.AbortAck(transfer_id=tid):
                    self._book.on_peer_stopped(tid, now)
                case p.Pong():
                    pass
                case _:
                    log.warning("peer %s: unexpected %s", peer.key, type(msg).__name__)

    def _on_welcome(self, peer: Peer, msg: p.Welcome, now: float) -> None:
        try:
            check_compat(self.compat, msg.compat, msg.version)
        except TransferError as exc:
            self._drop_peer(peer, "transfer_failed", str(exc), now)
            return
        peer.agent_name, peer.ready = msg.agent_name, True
        self._send_waiting(peer, now)

    def _send(self, peer: Peer, xfer: Transfer, now: float) -> None:
        try:
            peer.client.send(xfer.req)
        except TransferError as exc:
            self._book.fail(xfer, "transfer_failed", str(exc), now, acked=True)
            return
        xfer.phase = "sent"

    def _drop_peer(self, peer: Peer, reason: str, detail: str, now: float) -> None:
        """Fail every transfer of this peer; its socket is closed, a later submit reconnects."""
        log.warning("prefill peer %s dropped (%s): %s", peer.key, reason, detail)
        self._peers.pop(peer.key, None)
        if reason == "peer_dead":
            self.lost_peers.add(peer.key, detail)
        peer.client.close()
        if peer.agent_name:
            self.agent.remove_peer(peer.agent_name)
        self._fail_peer(peer.key, reason, detail, now)

    def _check_liveness(self, now: float) -> None:
        dead_after = self.settings.peer_dead_after_s
        for peer in list(self._peers.values()):
            if (why := peer.client.connection_lost()) is not None:
                self._drop_peer(peer, "peer_dead", why, now)
            elif peer.is_silent(now, dead_after):
                what = "heartbeat" if peer.ready else "handshake"
                self._drop_peer(peer, "peer_dead", f"no {what} answer for {dead_after:.1f} s", now)
            elif now >= peer.next_ping:
                peer.ping(now, self.settings.heartbeat_interval_s)

    # -- notifications, aborts -------------------------------------------------------------

    def _read_notifs(self, now: float) -> None:
        for sender, raw in self.agent.drain_notifs():
            try:
                notif = p.decode_notif(raw)
            except TransferError as exc:
                self.stats.unknown_notifs += 1
                log.warning("notification from %s: %s", sender, exc)
                continue
            self._book.on_notif(notif, sender, now)

    def _send_abort(self, xfer: Transfer) -> None:
        """Ask the transfer's peer to stop writing (`TransferBook.start_abort` calls this)."""
        peer = self._peers.get(xfer.peer_key)
        if peer is not None:
            # Best effort: the quiesce deadline still protects the pages.
            with contextlib.suppress(TransferError):
                peer.client.send(p.Abort(xfer.req.transfer_id, xfer.req.room))
