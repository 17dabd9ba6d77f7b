"""`ProtocolRouter`: one receiver for the engine over both wire protocols of prefill peers.

Native decode-worker peers go to `KVReceiver`, SGLang prefills to `SglangReceiver`; both share
ONE NIXL agent (pools and SGLang aux buffers registered once). `transfer.peer_protocol`:

    native | sglang   every peer speaks it (sglang: the server info is still fetched, for the
                      prefill page size and TP size)
    auto              probe the peer's bootstrap address (bootstrap_client.probe): JSON server
                      info = SGLang, a ZMTP greeting = native; no answer decides nothing

Per peer the decision (peer_protocols.py) is kept until a receiver drops the peer (peer_dead:
it died or restarted); the next request probes again. The engine asks `protocol_of(host,
port, since)` when a request arrives (None: a probe is in flight; "unavailable": the probe it
waited for found no peer to serve it) and submits once it is known. Transfer ids are the
router's own, unique across protocols. A submit to a peer not decided fails at once: peer_dead
(or transfer_failed) with the last miss's detail; bad_request if it was never probed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.nixl_agent import NixlAgent, unique_agent_name
from decode_worker.io.kv.peer import (
    ReceiverStats,
    TransferEvent,
    TransferReceiver,
    register_regions,
)
from decode_worker.io.kv.peer_protocols import Mode, PeerProtocol, PeerProtocols
from decode_worker.io.kv.receiver import KVReceiver
from decode_worker.io.kv.sglang.bootstrap_client import probe
from decode_worker.io.kv.sglang.receiver import AuxRegion, SglangReceiver

if TYPE_CHECKING:
    from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)

__all__ = ["PeerProtocol", "ProtocolRouter"]
_CANCEL_WAIT_S = 5.0  # how long a room's cancel waits for its peer's protocol to be known
_MAX_CANCELS = 4096  # cancels waiting at once (a flood to a dead peer): the oldest go first


class ProtocolRouter:
    """The engine's receiver (peer.TransferReceiver) over native and SGLang peers.

    `regions`: our "full", "swa" and "aux" RegionLayouts; `sglang_aux`: SGLang's 10 aux buffers
    as (addr, row_bytes, num_rows); `peer_protocol`: None = `settings.peer_protocol`;
    `landing`: where SGLang prefills of a model they lay out with full KV in every layer write
    (registered here, addressed by the SGLang receiver only). Owns the shared NIXL agent (and
    closes it). Raises ConfigError (NIXL).
    """

    def __init__(
        self,
        settings: TransferSettings,
        compat: p.ModelCompat,
        regions: dict[str, p.RegionLayout],
        sglang_aux: Sequence[AuxRegion],
        *,
        peer_protocol: Mode | None = None,
        kv_timeout_s: float = 30.0,
        agent_name: str | None = None,
        zmq_ports: tuple[int, int] | None = None,
        landing: p.RegionLayout | None = None,
    ) -> None:
        self.mode: Mode = peer_protocol or settings.peer_protocol
        self.settings = settings
        self.agent = NixlAgent(agent_name or unique_agent_name("decode"), settings.backend,
                               settings.progress_delay_us)  # fmt: skip
        sg_regions = regions if landing is None else {**regions, "landing": landing}
        register_regions(self.agent, sg_regions)
        self.native = KVReceiver(settings, compat, regions, kv_timeout_s, agent=self.agent)
        self.sglang: SglangReceiver | None = None
        if self.mode != "native":
            self.sglang = SglangReceiver(settings, compat, sg_regions, sglang_aux,
                                         agent=self.agent, kv_timeout_s=kv_timeout_s,
                                         zmq_ports=zmq_ports)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="peer-probe")
        self.protocols = PeerProtocols(self.mode, probe, self._pool,
                                       max(0.2, min(2.0, settings.peer_dead_after_s / 2)))
        self._routes: dict[int, tuple[str, int, str]] = {}  # our id -> (kind, inner id, peer)
        self._ours: dict[tuple[str, int], int] = {}  # (kind, inner id) -> our id
        self._synthetic: list[TransferEvent] = []
        self._cancels: list[tuple[float, str, int, int, str, str]] = []  # (until, peer, room..)
        self._own_failures: Counter[str] = Counter()  # of the transfers failed here
        self._next_id = 1
        self.stats = ReceiverStats()

    # -- protocol of a peer ----------------------------------------------------------------

    def protocol_of(self, host: str, port: int, since: float | None = None) -> PeerProtocol | None:
        """What the peer at host:port speaks (`PeerProtocols.get`: `since` is when the caller
        began waiting, None: now); None while a probe (started here if needed) runs."""
        return self.protocols.get(host, port, since)

    def peers_by_protocol(self) -> dict[str, int]:
        """How many known peers speak each protocol (for a gauge)."""
        return self.protocols.counts()

    def count_failure(self, reason: str) -> None:
        """A request its peer's protocol refused before any transfer (an unreachable peer:
        peer_dead) counts with the transfer failures, as its transfer would have."""
        self._own_failures[reason] += 1

    # -- owner API -------------------------------------------------------------------------

    def submit(
        self, host: str, port: int, *, rid: str, room: int, prompt_len: int, reused_len: int,
        swa_window_start: int, full_page_ids: list[int], swa_page_ids: list[int],
        aux_row: int, timeout_s: float | None = None, prompt_ids: list[int] | None = None,
    ) -> int:  # fmt: skip
        """`TransferReceiver.submit`, to the receiver of the peer's protocol (never probes: ask
        `protocol_of` first). A peer not decided gets "failed" (its last miss's reason and
        detail; bad_request if never probed), then "released", from the next `take_events`."""
        tid, self._next_id = self._next_id, self._next_id + 1
        key = f"{host}:{port}"
        proto = self.protocols.known(key) or self.protocols.last_miss(key)
        receiver = self._receiver(proto.kind if proto else "")
        if proto is None or receiver is None:
            reason, detail = ((proto.reason, proto.detail) if proto else
                              ("bad_request", f"prefill peer {key}: its protocol is not known "
                               "yet (ask protocol_of first)"))  # fmt: skip
            self._synthesize(tid, rid, room, reason, detail)
            return tid
        inner = receiver.submit(
            host, port, rid=rid, room=room, prompt_len=prompt_len, reused_len=reused_len,
            swa_window_start=swa_window_start, full_page_ids=full_page_ids,
            swa_page_ids=swa_page_ids, aux_row=aux_row, timeout_s=timeout_s,
            prompt_ids=prompt_ids,
        )  # fmt: skip
        self._routes[tid] = (proto.kind, inner, key)
        self._ours[proto.kind, inner] = tid
        return tid

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None:
        """Tell the prefill peer at host:port, in its protocol, that this worker ended `room`'s
        request (`reason`) before its KV arrived; until that protocol is known, or while the
        peer is unreachable (a restarting peer may still receive the router's copy of the
        request), the message waits in `take_events`, at most `_CANCEL_WAIT_S`, and the peer is
        probed at most once a heartbeat interval for it. Never raises."""
        until = time.monotonic() + _CANCEL_WAIT_S
        self._cancels.append((until, host, port, room, reason, detail))
        del self._cancels[:-_MAX_CANCELS]
        self._send_cancels()

    def _send_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        protos: dict[tuple[str, int], PeerProtocol | None] = {}  # one lookup per peer
        since = time.monotonic() - self.settings.heartbeat_interval_s  # a recent miss will do
        for until, host, port, room, reason, detail in cancels:
            if (host, port) not in protos:
                protos[host, port] = self.protocol_of(host, port, since)
            proto = protos[host, port]
            if (receiver := self._receiver(proto.kind if proto else "")) is not None:
                receiver.cancel_room(host, port, room, reason, detail)
            elif time.monotonic() < until:  # not known yet, or unreachable: it may be restarting
                self._cancels.append((until, host, port, room, reason, detail))

    def abort_transfer(self, transfer_id: int) -> None:
        route = self._routes.get(transfer_id)
        receiver = self._receiver(route[0]) if route else None
        if route is not None and receiver is not None:
            receiver.abort_transfer(route[1])

    def take_events(self) -> list[TransferEvent]:
        """Both receivers' events, under the router's ids; totals `stats`. A peer a receiver
        dropped as dead is undecided again before its transfers' "failed" events are
        returned (so the requests and cancels they end probe it again)."""
        events, self._synthetic = self._synthetic, []
        self._send_cancels()
        for kind in ("native", "sglang"):
            receiver = self._receiver(kind)
            if receiver is not None:
                events += [self._ours_event(kind, ev) for ev in receiver.take_events()]
        for key, detail in self.native.lost_peers.take() + (
                self.sglang.lost_peers.take() if self.sglang else []):
            self.protocols.forget(key, detail)
        parts = [self.native.stats] + ([self.sglang.stats] if self.sglang else [])
        self.stats.total(parts)
        self.stats.failures.update(self._own_failures)
        return events

    @property
    def num_in_flight(self) -> int:
        return self.native.num_in_flight + (self.sglang.num_in_flight if self.sglang else 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.sglang is not None:
            self.sglang.close()
        self.native.close()
        self.agent.close()

    # -- helpers ---------------------------------------------------------------------------

    def _receiver(self, kind: str) -> TransferReceiver | None:
        if kind == "native":
            return self.native
        return self.sglang if kind == "sglang" else None

    def _ours_event(self, kind: str, ev: TransferEvent) -> TransferEvent:
        tid = self._ours.get((kind, ev.transfer_id), 0)
        if ev.kind != "failed":
            self._ours.pop((kind, ev.transfer_id), None)
            self._routes.pop(tid, None)
        return dataclasses.replace(ev, transfer_id=tid, wire_id=ev.wire_id or ev.transfer_id)

    def _synthesize(self, tid: int, rid: str, room: int, reason: str, detail: str) -> None:
        log.warning("transfer %d rid=%s room=%d failed (%s): %s", tid, rid, room, reason, detail)
        self._own_failures[reason] += 1
        self._synthetic += [
            TransferEvent("failed", tid, rid, room, reason, detail, protocol="unknown"),
            TransferEvent("released", tid, rid, room, protocol="unknown"),
        ]
