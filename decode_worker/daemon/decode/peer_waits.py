"""The request table's side of prefill peers (mixed into `RequestTable`, requests.py).

A request whose KV comes from a prefill peer waits for the peer's protocol (PEER; `poll`
resolves it), then, once admitted, for landing room (LANDING) and for its transfer (TRANSFER;
`poll` hands it the receiver's events); a request that ends before its first token is ended at
its peer too (`_tell_peer`), and requests refused at the door have their rooms ended there
(`refuse`). The table's state and its one exit are `RequestTable`'s. Compute thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from decode_worker.core.admission import Admit
from decode_worker.daemon.decode.bridge import FINISH_REASONS, RefuseRequest
from decode_worker.daemon.decode.fetcher import KVFetcher
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.parking import Parked, ParkingLot, Wait
from decode_worker.errors import DecodeWorkerError
from decode_worker.io.kv.peer import TransferEvent

log = logging.getLogger(__name__)


class TransferStopper(Protocol):
    """What the table needs of the KV receiver: stop one transfer (its "released" or "done"
    event follows); tell a prefill peer that a room's request ended."""

    def abort_transfer(self, transfer_id: int) -> None: ...

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None: ...


class PeerWaits:
    """PEER, LANDING and TRANSFER, and telling a peer of an end (see the module doc)."""

    fetcher: KVFetcher
    transfers: TransferStopper
    parked: ParkingLot
    arrivals: list[LiveRequest]
    requests_total: Counter[str]
    aborts_total: Counter[str]

    def end(self, live: LiveRequest, reason: str, message: str, now: float, *,
            matched_stop: int | None = None, failed: bool = False) -> None:
        raise NotImplementedError  # `RequestTable.end`, the one exit

    def _settle(self, rec: Parked, now: float) -> None:
        raise NotImplementedError  # `RequestTable._settle`

    def wait_for_peer(self, live: LiveRequest, now: float) -> None:
        """`live` waits until its peer's protocol is known; then `poll` queues or ends it."""
        self.parked.park(live, Wait.PEER, since=now)

    def _resolve(self, rec: Parked, now: float) -> None:
        """`rec`'s peer protocol, if known: queue the request, or end it when that peer cannot
        serve it (unreachable: counted as a transfer failure)."""
        live = rec.live
        proto = self.fetcher.protocol_of(live, rec.since)
        if proto is None:
            return
        self.parked.move(rec, None)
        refusal = self.fetcher.refusal(live, proto)
        if refusal is not None:
            self.end(live, *refusal, now, failed=True)
        else:
            self.arrivals.append(live)

    def _post(self, live: LiveRequest, admit: Admit, now: float) -> None:
        """Post `live`'s transfer (TRANSFER), or it waits for landing room behind those that
        wait already (LANDING), or it ends when it can never get that room."""
        fetcher, lot = self.fetcher, self.parked
        why = fetcher.landing_refusal(live, admit)
        if why is not None:
            self.end(live, "transfer_failed", f"KV transfer refused: {why}", now, failed=True)
            return
        behind_others = fetcher.lands(live) and lot.has(Wait.LANDING)
        if not behind_others and fetcher.post(live, admit, now):
            lot.park(live, Wait.TRANSFER)
            return
        log.info("rid=%s waits for landing room", live.rid)
        lot.park(live, Wait.LANDING, admit=admit)

    def _post_landing(self, rec: Parked, now: float) -> bool:
        """Post the transfer of a request that waited for landing room; False while there is
        still too little (it keeps waiting). An input the receiver refuses ends it."""
        live, admit = rec.live, rec.admit
        assert admit is not None  # LANDING keeps its admission
        try:
            if not self.fetcher.post(live, admit, now):
                return False
        except DecodeWorkerError as exc:  # this request's inputs, not the engine
            self.parked.move(rec, None)
            self.end(live, "bad_request", str(exc), now, failed=True)
            return True
        self.parked.move(rec, Wait.TRANSFER)
        return True

    def _transfer_event(self, rec: Parked, ev: TransferEvent, now: float) -> None:
        live = rec.live
        if ev.kind == "failed":  # answer now; the pages wait until the peer stopped writing
            if rec.status is None:
                reason = ev.reason or "transfer_failed"
                log.warning("rid=%s transfer %d failed (%s): %s", live.rid, ev.transfer_id,
                            reason, ev.detail)
                self.end(live, reason, f"KV transfer failed ({reason}): {ev.detail}", now,
                         failed=True)
            return
        first = self.fetcher.transfer_over(live, ev)
        if rec.status is not None:  # it had ended: its pages go back once nothing writes them
            if live.is_restoring:
                self.parked.move(rec, Wait.RESTORE)
            else:
                self._settle(rec, now)
            return
        if first is None:
            self.parked.move(rec, None)
            why = ("first token missing or for another room" if ev.kind == "done" else
                   "the KV transfer was released before it completed")
            self.end(live, "transfer_failed", why, now, failed=True)
            return
        if live.is_restoring:
            self.parked.move(rec, Wait.RESTORE)
            rec.then = lambda t: self.fetcher.arrive(live, first, t)
            return
        live.restore = None
        self.fetcher.arrive(live, first, now)
        self.parked.move(rec, Wait.START)

    def refuse(self, cmd: RefuseRequest) -> None:
        """Requests the worker refused before they reached the engine (at the HTTP door):
        counted as aborted for `cmd.reason`, and each room ended at its prefill peer."""
        self.requests_total["aborted"] += cmd.num_requests
        self.aborts_total[cmd.reason] += cmd.num_requests
        log.info("refused %d request(s) (%s): %s", cmd.num_requests, cmd.reason, cmd.message)
        for host, port, room in cmd.rooms:
            self._cancel_room(host, port, room, cmd.reason, cmd.message)

    def _tell_peer(self, live: LiveRequest, reason: str, message: str) -> None:
        """A request that ends before its first token came (refused at admission, client
        abort, drain, a failed transfer) ends at its prefill peer too, which then answers the
        router's copy at once instead of at its own timeout; sent for a peer found dead too
        (one that restarts within seconds may still get the router's copy)."""
        cmd = live.cmd
        if live.req.output_ids or reason in FINISH_REASONS:
            return
        self._cancel_room(cmd.bootstrap_host, cmd.bootstrap_port or 0, cmd.bootstrap_room,
                          reason, message)

    def _cancel_room(self, host: str | None, port: int, room: int | None, reason: str,
                     message: str) -> None:
        """End `room` at the prefill peer host:port (in its protocol), if the address and room
        are whole."""
        if host and room is not None and 0 < port < 65536:
            self.transfers.cancel_room(host, port, room, reason, message)
