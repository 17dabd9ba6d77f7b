"""Records of the decode-side receiver: per peer, per transfer, its events and its stats."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import zmq

from decode_worker.core.types import MemoryRegion
from decode_worker.errors import TransferError
from decode_worker.io.kv.bootstrap import BootstrapClient
from decode_worker.io.kv.nixl_agent import NixlAgent
from decode_worker.io.kv.protocol import Notif, Ping, RegionLayout, TransferDone, TransferRequest

Phase = Literal["queued", "sent", "aborting"]


@dataclass(slots=True)
class Peer:
    """One prefill peer: its control socket, handshake state and liveness clock."""

    key: str
    client: BootstrapClient
    next_ping: float
    awaiting_since: float | None  # when our oldest unanswered Hello/Ping was sent
    ready: bool = False
    agent_name: str = ""
    waiting: list[int] = field(default_factory=list)  # transfer ids queued until the handshake
    ping_seq: int = 0

    @classmethod
    def open(
        cls,
        ctx: zmq.Context[zmq.Socket[bytes]],
        host: str,
        port: int,
        now: float,
        interval_s: float,
    ) -> Peer:
        client = BootstrapClient(ctx, host, port)
        return cls(client.address, client, next_ping=now + interval_s, awaiting_since=now)

    def heard(self) -> None:
        """Any message from the peer answers every outstanding Hello/Ping."""
        self.awaiting_since = None

    def is_silent(self, now: float, dead_after_s: float) -> bool:
        """True when a Hello or Ping has been unanswered for `dead_after_s`. Time the owner
        spent not polling does not count against the peer (nothing was asked then)."""
        return self.awaiting_since is not None and now - self.awaiting_since > dead_after_s

    def ping(self, now: float, interval_s: float) -> None:
        """Send one heartbeat; a send failure is left to the liveness deadline to judge."""
        self.ping_seq += 1
        self.next_ping = now + interval_s
        if self.awaiting_since is None:
            self.awaiting_since = now
        with contextlib.suppress(TransferError):
            self.client.send(Ping(self.ping_seq))


@dataclass(slots=True)
class Transfer:
    """One requested transfer. `phase`: queued (waiting for the handshake), sent, aborting
    (failed or aborted; the pages wait until `release_at` or the peer's ack)."""

    req: TransferRequest
    peer_key: str
    started_at: float
    deadline: float
    phase: Phase = "queued"
    release_at: float = 0.0
    parts: set[int] = field(default_factory=set)
    num_descriptors: int = 0
    landed: bool = False  # every part's notification came
    peer_done: TransferDone | None = None  # the peer's TransferDone (its checksum), once come

    def add_part(self, notif: Notif) -> bool:
        """Record one WRITE's notification; True once every part has landed."""
        if notif.part not in self.parts:
            self.parts.add(notif.part)
            self.num_descriptors += notif.num_descriptors
        return len(self.parts) >= notif.num_parts


@dataclass(slots=True)
class LostPeers:
    """The peers a receiver dropped as dead, as ("host:port", why), until its owner takes them
    (each once): such a peer may come back speaking another protocol."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def add(self, key: str, why: str) -> None:
        self.items.append((key, why))

    def take(self) -> list[tuple[str, str]]:
        out, self.items = self.items, []
        return out


EventKind = Literal["done", "failed", "released"]


@dataclass(frozen=True, slots=True)
class TransferEvent:
    """One outcome for the owner. On "done": bytes, descriptors, the full-KV tokens received
    (`prompt_len - reused_len`) and the time from submit to the last notification."""

    kind: EventKind
    transfer_id: int
    rid: str
    room: int
    reason: str | None = None  # abort label, on "failed"
    detail: str = ""
    num_bytes: int = 0
    num_descriptors: int = 0
    num_tokens: int = 0
    duration_s: float = 0.0
    protocol: str = "native"  # "native" or "sglang": the wire protocol of the transfer's peer
    wire_id: int = 0  # the transfer id the peer was sent (the ProtocolRouter's own id differs)


@dataclass(slots=True)
class ReceiverStats:
    """Plain counters: the daemon turns them into metrics once per step (unknown and late
    notifications live only here). `samples` holds (duration_s, descriptors) of each "done"
    until the daemon takes them (`take_samples`); past `MAX_SAMPLES` the oldest are dropped.
    `quiesce_expired`: failed or aborted transfers whose pages were released by the
    `abort_quiesce_s` clock, not by the peer's word; `bad_frames`: undecodable peer messages."""

    done: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    unknown_notifs: int = 0
    late_notifs: int = 0
    bytes_received: int = 0
    tokens_received: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)
    quiesce_expired: int = 0
    bad_frames: int = 0
    kv_checksum_failures: int = 0

    def count_done(self, num_bytes: int, num_tokens: int, duration_s: float,
                   num_descriptors: int) -> None:
        self.done += 1
        self.bytes_received += num_bytes
        self.tokens_received += num_tokens
        self.samples.append((duration_s, num_descriptors))
        if len(self.samples) > MAX_SAMPLES:
            del self.samples[: len(self.samples) - MAX_SAMPLES]

    def take_samples(self) -> list[tuple[float, int]]:
        out, self.samples = self.samples, []
        return out

    def total(self, parts: Sequence[ReceiverStats]) -> None:
        """Set every counter to its sum over `parts` and move their samples here (so one
        stats object totals several receivers; the parts keep their own counts)."""
        self.done = sum(p.done for p in parts)
        self.failures = Counter()
        for p in parts:
            self.failures.update(p.failures)
        self.unknown_notifs = sum(p.unknown_notifs for p in parts)
        self.late_notifs = sum(p.late_notifs for p in parts)
        self.bytes_received = sum(p.bytes_received for p in parts)
        self.tokens_received = sum(p.tokens_received for p in parts)
        self.quiesce_expired = sum(p.quiesce_expired for p in parts)
        self.bad_frames = sum(p.bad_frames for p in parts)
        self.kv_checksum_failures = sum(p.kv_checksum_failures for p in parts)
        for p in parts:
            self.samples += p.take_samples()
        if len(self.samples) > MAX_SAMPLES:
            del self.samples[: len(self.samples) - MAX_SAMPLES]


MAX_SAMPLES = 4096


class TransferReceiver(Protocol):
    """What every decode-side receiver offers its owner, the compute thread (docs/CONTRACTS.md;
    implemented by `KVReceiver`, `SglangReceiver` and `ProtocolRouter`).

    Per transfer the owner gets "done", or "failed" (reason label + detail) then "released";
    after the owner's `abort_transfer`, only "released". `submit` never raises for a
    per-request problem (it comes back as "failed"); `take_events` (the transfer events since
    the last call) never blocks.
    """

    stats: ReceiverStats

    def submit(
        self, host: str, port: int, *, rid: str, room: int, prompt_len: int, reused_len: int,
        swa_window_start: int, full_page_ids: list[int], swa_page_ids: list[int],
        aux_row: int, timeout_s: float | None = None, prompt_ids: list[int] | None = None,
    ) -> int: ...

    def abort_transfer(self, transfer_id: int) -> None: ...

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None: ...

    def take_events(self) -> list[TransferEvent]: ...

    @property
    def num_in_flight(self) -> int: ...

    def close(self) -> None: ...


def transfer_bytes(req: TransferRequest, regions: dict[str, RegionLayout]) -> int:
    """Bytes one request moves: its full pages and SWA pages over every layer, plus the aux row."""
    full, swa, aux = regions["full"], regions["swa"], regions["aux"]
    return (
        len(req.full_page_ids) * full.num_layers * full.row_bytes
        + len(req.swa_page_ids) * swa.num_layers * swa.row_bytes
        + aux.row_bytes
    )


def register_regions(agent: NixlAgent, regions: dict[str, RegionLayout]) -> None:
    """Register every non-empty region with `agent` (once per agent, whichever receivers share
    it). Raises ConfigError naming the likely fix when the backend refuses."""
    agent.register([MemoryRegion(r.addr, r.length, r.device_id, r.kind)
                    for r in regions.values() if r.length])  # fmt: skip
