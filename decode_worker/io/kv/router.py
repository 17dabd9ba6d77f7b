"""`ProtocolRouter`: one receiver for the engine over both wire protocols of prefill peers.

Native decode-worker peers go to `KVReceiver`, SGLang prefills to `SglangReceiver`; both share
ONE NIXL agent (pools and SGLang aux buffers registered once). `transfer.peer_protocol`:

    native | sglang   every peer speaks it (sglang: the server info is still fetched, for the
                      prefill page size and TP size)
    auto              probe the peer's bootstrap address once (bootstrap_client.probe): JSON
                      server info or 503 = SGLang, a ZMQ greeting = native; cached per peer,
                      dropped when a transfer of that peer fails with peer_dead (restart)

The engine asks `protocol_of(host, port)` when a request arrives (None: a probe is in flight)
and submits once it is known. Transfer ids are the router's own, unique across protocols.
A peer whose probe found nothing ("unavailable": refused, silent, or not the configured
protocol) still takes a submit, which fails with peer_dead; one not probed yet, bad_request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Literal

from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.nixl_agent import NixlAgent, unique_agent_name
from decode_worker.io.kv.peer import (
    ReceiverStats,
    TransferEvent,
    TransferReceiver,
    register_regions,
)
from decode_worker.io.kv.receiver import KVReceiver
from decode_worker.io.kv.sglang.bootstrap_client import Probe, probe
from decode_worker.io.kv.sglang.receiver import AuxRegion, SglangReceiver

if TYPE_CHECKING:
    from decode_worker.settings import TransferSettings

log = logging.getLogger(__name__)

Mode = Literal["auto", "native", "sglang"]
Kind = Literal["native", "sglang", "unavailable"]
_CANCEL_WAIT_S = 5.0  # how long a room's cancel waits for its peer's protocol to be known
_MAX_CANCELS = 4096  # cancels waiting at once (a flood to a dead peer): the oldest go first


@dataclasses.dataclass(frozen=True, slots=True)
class PeerProtocol:
    """What a peer speaks; for "sglang" its page size and attention TP size; for
    "unavailable" why (unreachable, or not what `peer_protocol` says)."""

    kind: Kind
    prefill_page_size: int | None = None
    tp_size: int | None = None
    detail: str = ""


class ProtocolRouter:
    """The engine's receiver (peer.TransferReceiver) over native and SGLang peers.

    `regions`: our "full", "swa" and "aux" RegionLayouts; `sglang_aux`: SGLang's 10 aux buffers
    as (addr, row_bytes, num_rows); `peer_protocol`: None = `settings.peer_protocol`. Owns the
    shared NIXL agent (and closes it). Raises ConfigError (NIXL).
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
    ) -> None:
        self.mode: Mode = peer_protocol or settings.peer_protocol
        self.settings = settings
        self.agent = NixlAgent(agent_name or unique_agent_name("decode"), settings.backend,
                               settings.progress_delay_us)  # fmt: skip
        register_regions(self.agent, regions)
        self.native = KVReceiver(settings, compat, regions, kv_timeout_s, agent=self.agent)
        self.sglang: SglangReceiver | None = None
        if self.mode != "native":
            self.sglang = SglangReceiver(settings, compat, regions, sglang_aux, agent=self.agent,
                                         kv_timeout_s=kv_timeout_s, zmq_ports=zmq_ports)
        self._probe_timeout_s = max(0.2, min(2.0, settings.peer_dead_after_s / 2))
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peer-probe")
        self._known: dict[str, PeerProtocol] = {}
        self._probes: dict[str, Future[Probe]] = {}
        self._recent: dict[str, tuple[float, PeerProtocol | None]] = {}  # key -> (until, answer)
        self._routes: dict[int, tuple[str, int, str]] = {}  # our id -> (kind, inner id, peer)
        self._ours: dict[tuple[str, int], int] = {}  # (kind, inner id) -> our id
        self._synthetic: list[TransferEvent] = []
        self._cancels: list[tuple[float, str, int, int, str, str]] = []  # (until, peer, room..)
        self._own_failures: Counter[str] = Counter()  # of the transfers failed here
        self._next_id = 1
        self.stats = ReceiverStats()

    # -- protocol of a peer ----------------------------------------------------------------

    def protocol_of(self, host: str, port: int) -> PeerProtocol | None:
        """What the peer at host:port speaks; None while a probe (started here) runs."""
        key = f"{host}:{port}"
        if self.mode == "native":
            return self._known.setdefault(key, PeerProtocol("native"))
        if key in self._known:
            return self._known[key]
        until, answer = self._recent.get(key, (0.0, None))
        if time.monotonic() < until:
            return answer  # a recent 503 (None) or "unavailable": not probed again yet
        job = self._probes.get(key)
        if job is None:
            self._probes[key] = self._pool.submit(probe, host, port, self._probe_timeout_s)
            return None
        if not job.done():
            return None
        del self._probes[key]
        return self._learn(key, job.result())

    def _learn(self, key: str, found: Probe) -> PeerProtocol | None:
        if found.kind == "sglang" and found.info is None:  # 503: its ranks still register
            self._recent[key] = (time.monotonic() + 0.5, None)
            return None
        if found.kind == "native" and self.mode == "sglang":
            found = Probe("unavailable", detail="answers as a native decode-worker peer, but "
                                                "transfer.peer_protocol is 'sglang'")
        if found.kind == "unavailable":  # kept one heartbeat interval, then probed again
            proto = PeerProtocol("unavailable", detail=found.detail)
            self._recent[key] = (time.monotonic() + self.settings.heartbeat_interval_s, proto)
            return proto
        info = found.info
        proto = PeerProtocol(found.kind, info.page_size if info else None,
                             info.attn_tp_size if info else None)  # fmt: skip
        log.info("prefill peer %s speaks %s%s", key, proto.kind, f" (page {proto.prefill_page_size}"
                 f", tp {proto.tp_size})" if info else "")  # fmt: skip
        self._known[key] = proto
        return proto

    def peers_by_protocol(self) -> dict[str, int]:
        """How many known peers speak each protocol (for a gauge)."""
        out = {"native": 0, "sglang": 0}
        for proto in self._known.values():
            out[proto.kind] = out.get(proto.kind, 0) + 1
        return out

    # -- owner API -------------------------------------------------------------------------

    def submit(
        self, host: str, port: int, *, rid: str, room: int, prompt_len: int, reused_len: int,
        swa_window_start: int, full_page_ids: list[int], swa_page_ids: list[int],
        aux_slot: int, timeout_s: float | None = None, prompt_ids: list[int] | None = None,
    ) -> int:  # fmt: skip
        """`TransferReceiver.submit`, to the receiver of the peer's protocol. Ask `protocol_of`
        first: a peer whose protocol is not known yet gets "failed" (bad_request), an
        "unavailable" one "failed" (peer_dead), then "released", from the next `poll`."""
        tid, self._next_id = self._next_id, self._next_id + 1
        key = f"{host}:{port}"
        proto = self._known.get(key) or self.protocol_of(host, port)
        receiver = self._receiver(proto.kind if proto else "")
        if proto is None or receiver is None:
            reason, detail = (("peer_dead", proto.detail) if proto else
                              ("bad_request", "its protocol is not known yet (probe running)"))
            self._synthesize(tid, rid, room, reason, f"prefill peer {key}: {detail}")
            return tid
        inner = receiver.submit(
            host, port, rid=rid, room=room, prompt_len=prompt_len, reused_len=reused_len,
            swa_window_start=swa_window_start, full_page_ids=full_page_ids,
            swa_page_ids=swa_page_ids, aux_slot=aux_slot, timeout_s=timeout_s,
            prompt_ids=prompt_ids,
        )  # fmt: skip
        self._routes[tid] = (proto.kind, inner, key)
        self._ours[proto.kind, inner] = tid
        return tid

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None:
        """Tell the prefill peer at host:port, in its protocol, that this worker ended `room`'s
        request (`reason`) before its KV arrived; until that protocol is known, or while the
        peer is unreachable (a restarting peer may still receive the router's copy of the
        request), the message waits in `poll`, at most `_CANCEL_WAIT_S`. Never raises."""
        until = time.monotonic() + _CANCEL_WAIT_S
        self._cancels.append((until, host, port, room, reason, detail))
        del self._cancels[:-_MAX_CANCELS]
        self._send_cancels()

    def _send_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        protos: dict[tuple[str, int], PeerProtocol | None] = {}  # one lookup per peer
        for until, host, port, room, reason, detail in cancels:
            if (host, port) not in protos:
                protos[host, port] = self.protocol_of(host, port)
            proto = protos[host, port]
            if (receiver := self._receiver(proto.kind if proto else "")) is not None:
                receiver.cancel_room(host, port, room, reason, detail)
            elif time.monotonic() < until:  # not known yet, or unreachable: it may be restarting
                self._cancels.append((until, host, port, room, reason, detail))

    def abort(self, transfer_id: int) -> None:
        route = self._routes.get(transfer_id)
        receiver = self._receiver(route[0]) if route else None
        if route is not None and receiver is not None:
            receiver.abort(route[1])

    def poll(self) -> list[TransferEvent]:
        """Both receivers' events, under the router's ids; totals `stats`."""
        events, self._synthetic = self._synthetic, []
        self._send_cancels()
        for kind in ("native", "sglang"):
            receiver = self._receiver(kind)
            if receiver is not None:
                events += [self._ours_event(kind, ev) for ev in receiver.poll()]
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
        route = self._routes.get(tid)
        if ev.kind != "failed":
            self._ours.pop((kind, ev.transfer_id), None)
            self._routes.pop(tid, None)
        elif ev.reason == "peer_dead" and route is not None:
            self._known.pop(route[2], None)  # it may come back as something else: probe again
        return dataclasses.replace(ev, transfer_id=tid, wire_id=ev.wire_id or ev.transfer_id)

    def _synthesize(self, tid: int, rid: str, room: int, reason: str, detail: str) -> None:
        log.warning("transfer %d rid=%s room=%d failed (%s): %s", tid, rid, room, reason, detail)
        self._own_failures[reason] += 1
        self._synthetic += [
            TransferEvent("failed", tid, rid, room, reason, detail, protocol="unknown"),
            TransferEvent("released", tid, rid, room, protocol="unknown"),
        ]
