"""Per-peer and per-transfer state of the decode-side receiver (plain records, no I/O policy)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import zmq

from decode_worker.errors import TransferError
from decode_worker.io.bootstrap import BootstrapClient
from decode_worker.io.protocol import Notif, Ping, TransferRequest

Phase = Literal["queued", "sent", "aborting"]


@dataclass(slots=True)
class Peer:
    """One prefill peer: its control socket, handshake state and liveness clock."""

    key: str
    client: BootstrapClient
    last_seen: float
    next_ping: float
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
        return cls(client.address, client, last_seen=now, next_ping=now + interval_s)

    def ping(self, now: float, interval_s: float) -> None:
        """Send one heartbeat; a send failure is left to the liveness deadline to judge."""
        self.ping_seq += 1
        self.next_ping = now + interval_s
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

    def add_part(self, notif: Notif) -> bool:
        """Record one WRITE's notification; True once every part has landed."""
        if notif.part not in self.parts:
            self.parts.add(notif.part)
            self.num_descriptors += notif.num_descriptors
        return len(self.parts) >= notif.num_parts
