"""`SglangPeers`: the SGLang prefill peers of one receiver, driven without blocking.

Per peer (peers.py has the records):

    connecting: the set-up job (thread pool: server info, compatibility, rank endpoints, our
                local address) is started when due and taken when done;
                503 -> retry in 0.5 s; silent -> retry each heartbeat, up to peer_dead_after_s;
                refused / unresolvable -> lost (peer_dead); not SGLang, bad answer, refused by
                the compatibility check -> lost (transfer_failed); nobody waiting -> forgotten
    ready:      status socket bound toward it, PUSH socket per rank, registration sent to each;
                GET /health every heartbeat_interval_s; refused, silent for peer_dead_after_s,
                or a rank's connection dropped -> lost (peer_dead)

`advance` returns what changed (a peer that became ready, a `PeerLost`); the receiver acts on
it (sends the waiting transfers, fails the lost peer's transfers). Owner thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from decode_worker.errors import TransferError
from decode_worker.io.kv.peer import LostPeers
from decode_worker.io.kv.protocol import ModelCompat, RegionLayout
from decode_worker.io.kv.sglang.bootstrap_client import PeerUnreachable, check_health
from decode_worker.io.kv.sglang.layout import SglangLayout, build_layout
from decode_worker.io.kv.sglang.links import RankLinks, StatusInbox
from decode_worker.io.kv.sglang.peers import PeerSetup, SglangPeer, fetch_setup

if TYPE_CHECKING:
    from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)

# (layout, our ip, our port) -> the registration frames for every rank of a peer
RegistrationOf = Callable[[SglangLayout, str, int], list[bytes]]


@dataclass(frozen=True, slots=True)
class PeerLost:
    """A peer that was forgotten: fail its transfers with `reason` (a label) and `detail`."""

    peer: SglangPeer
    reason: str
    detail: str


class SglangPeers:
    """Peers by bootstrap address "host:port" (see module doc)."""

    def __init__(
        self, settings: TransferSettings, compat: ModelCompat, regions: dict[str, RegionLayout],
        ctx: zmq.Context[zmq.Socket[bytes]], inbox: StatusInbox,
        registration_of: RegistrationOf, http_timeout_s: float,
    ) -> None:  # fmt: skip
        self.settings, self.compat, self.regions = settings, compat, regions
        self._ctx, self._inbox, self._registration_of = ctx, inbox, registration_of
        self.http_timeout_s = http_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sglang-bootstrap")
        self.peers: dict[str, SglangPeer] = {}
        self.lost = LostPeers()  # the peers lost as dead (peer_dead), until the owner takes them

    def get_or_add(self, key: str, host: str, port: int, now: float) -> SglangPeer:
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = SglangPeer(key, host, port, now)
        return peer

    def advance(self, now: float, is_live: Callable[[int], bool]) -> list[SglangPeer | PeerLost]:
        """Drive every peer one step; `is_live(tid)`: a waiting transfer is still wanted."""
        changes: list[SglangPeer | PeerLost] = []
        for peer in list(self.peers.values()):
            try:
                change = self._advance(peer, now, is_live)
            except PeerLostError as exc:
                change = self._lose(peer, exc.reason, str(exc))
            if change is not None:
                changes.append(change)
        return changes

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _lose(self, peer: SglangPeer, reason: str, detail: str) -> PeerLost | None:
        self.peers.pop(peer.key, None)
        peer.close()
        if not reason:
            return None
        log.warning("SGLang prefill %s dropped (%s): %s", peer.key, reason, detail)
        if reason == "peer_dead":
            self.lost.add(peer.key, detail)
        return PeerLost(peer, reason, detail)

    def _advance(
        self, peer: SglangPeer, now: float, is_live: Callable[[int], bool]
    ) -> SglangPeer | PeerLost | None:
        if not peer.ready:
            return self._advance_setup(peer, now, is_live)
        assert peer.links is not None  # ready
        rank = peer.links.disconnected()
        if rank is not None:
            raise PeerLostError("peer_dead", f"prefill rank dp={rank[0]} tp={rank[1]} "
                                "disconnected")  # fmt: skip
        self._advance_health(peer, now)
        return None

    def _advance_setup(
        self, peer: SglangPeer, now: float, is_live: Callable[[int], bool]
    ) -> SglangPeer | PeerLost | None:
        """Start the set-up job when due, take its result when done. Raises PeerLostError."""
        if peer.job is None:
            peer.waiting = [tid for tid in peer.waiting if is_live(tid)]
            if not peer.waiting and not peer.cancels:
                return self._lose(peer, "", "")  # nobody waits: forget it quietly
            if now >= peer.retry_at:
                peer.job = self._pool.submit(fetch_setup, peer.host, peer.port, self.compat,
                                             self.http_timeout_s)  # fmt: skip
            return None
        if not peer.job.done():
            return None
        job, peer.job = peer.job, None
        try:
            setup = job.result()
        except PeerUnreachable as exc:
            if exc.definite or now - peer.first_try > self.settings.peer_dead_after_s:
                raise PeerLostError("peer_dead", f"SGLang bootstrap server: {exc}") from None
            peer.retry_at = now + self.settings.heartbeat_interval_s
            return None
        except TransferError as exc:  # not SGLang, a bad answer, refused as incompatible
            raise PeerLostError("transfer_failed", str(exc)) from None
        if setup is None:  # 503: the prefill's ranks are still registering
            peer.retry_at = now + min(0.5, self.settings.heartbeat_interval_s)
            return None
        try:
            self._open(peer, setup, now)
        except TransferError as exc:
            raise PeerLostError("transfer_failed", str(exc)) from None
        return peer

    def _open(self, peer: SglangPeer, setup: PeerSetup, now: float) -> None:
        """Bind toward the peer, connect every rank, send our registration to each."""
        info = setup.info
        assert info.page_size is not None  # check_server_info refused None
        peer.layout = build_layout(self.regions, self.compat, info.page_size)
        peer.our_ip, peer.our_port = setup.local_ip, self._inbox.endpoint_for(setup.local_ip)
        peer.setup, peer.links = setup, RankLinks(self._ctx, setup.endpoints)
        frames = self._registration_of(peer.layout, peer.our_ip, peer.our_port)
        for ep in setup.endpoints:
            peer.links.send((ep.dp_rank, ep.tp_rank), frames)
        log.info("SGLang prefill %s: registered with %d ranks (tp %d, dp %d, page %d: r=%d) "
                 "%.0f ms after the first request", peer.key, len(setup.endpoints),
                 info.attn_tp_size, info.dp_size, info.page_size, peer.layout.ratio,
                 1e3 * (now - peer.first_try))  # fmt: skip
        peer.next_health, peer.awaiting_since = now + self.settings.heartbeat_interval_s, None

    def _advance_health(self, peer: SglangPeer, now: float) -> None:
        """GET /health each heartbeat interval. Raises PeerLostError (refused, or silent)."""
        dead_after = self.settings.peer_dead_after_s
        if peer.health is not None and peer.health.done():
            exc = peer.health.exception()
            peer.health = None
            if exc is None:
                peer.awaiting_since = None
            elif isinstance(exc, PeerUnreachable) and exc.definite:
                raise PeerLostError("peer_dead", f"SGLang bootstrap server gone: {exc}")
            else:
                log.info("SGLang prefill %s: /health: %s", peer.key, exc)
        if peer.is_silent(now, dead_after):
            raise PeerLostError("peer_dead", f"no /health answer for {dead_after:.1f} s")
        if peer.health is None and now >= peer.next_health:
            peer.health = self._pool.submit(check_health, peer.host, peer.port,
                                            self.http_timeout_s)  # fmt: skip
            peer.next_health = now + self.settings.heartbeat_interval_s
            if peer.awaiting_since is None:
                peer.awaiting_since = now


class PeerLostError(Exception):
    """Internal to `SglangPeers.advance`: this peer is lost (`reason` label, message)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
