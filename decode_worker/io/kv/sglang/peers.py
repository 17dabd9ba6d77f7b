"""Records of the SGLang receiver: one prefill peer (set-up, sockets, liveness) and the
SGLang side of one transfer (its ranks and what each rank said).

A peer goes `connecting` (a set-up job runs in the receiver's thread pool: server info, the
compatibility check, every rank's endpoint, our local address toward it) -> `ready` (PUSH
socket per rank, our registration sent to each) -> forgotten (dead, refused, or restarted: the
next submit sets it up again).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from decode_worker.io.kv.protocol import ModelCompat
from decode_worker.io.kv.sglang.bootstrap_client import (
    fetch_rank_endpoint,
    fetch_server_info,
    local_ip_toward,
)
from decode_worker.io.kv.sglang.frames import AbortAck, KVStatus, Status
from decode_worker.io.kv.sglang.layout import SglangLayout
from decode_worker.io.kv.sglang.links import RankLinks
from decode_worker.io.kv.sglang.server_info import (
    PrefillServerInfo,
    RankEndpoint,
    check_server_info,
    prefill_dp_rank,
)

Rank = tuple[int, int]  # (dp_rank, tp_rank)


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """What the set-up job found: the server info (already checked), every rank's PULL
    endpoint, and our local address toward the peer."""

    info: PrefillServerInfo
    endpoints: tuple[RankEndpoint, ...]
    local_ip: str


def fetch_setup(host: str, port: int, compat: ModelCompat, timeout_s: float) -> PeerSetup | None:
    """Blocking (thread pool only). None while the prefill's ranks register (503).

    Raises PeerUnreachable, NotHttp, ProtocolError, or IncompatiblePeer (refused here, before
    any rank endpoint is asked for)."""
    info = fetch_server_info(host, port, timeout_s)
    if info is None:
        return None
    check_server_info(info, compat)
    endpoints = []
    for dp in range(info.dp_size):
        for tp in range(info.attn_tp_size):
            ep = fetch_rank_endpoint(host, port, dp, tp, timeout_s)
            if ep is None:
                return None
            endpoints.append(ep)
    return PeerSetup(info, tuple(endpoints), local_ip_toward(host, port))


@dataclass(slots=True)
class SglangPeer:
    """One SGLang prefill instance, by bootstrap address `key` = "host:port"."""

    key: str
    host: str
    port: int
    first_try: float
    job: Future[PeerSetup | None] | None = None
    retry_at: float = 0.0
    setup: PeerSetup | None = None
    layout: SglangLayout | None = None
    links: RankLinks | None = None
    our_ip: str = ""
    our_port: int = 0
    waiting: list[int] = field(default_factory=list)  # transfer ids queued until ready
    cancels: list[tuple[int, str, str]] = field(default_factory=list)  # rooms to ABORT once ready
    health: Future[None] | None = None
    next_health: float = 0.0
    awaiting_since: float | None = None  # when our oldest unanswered /health was asked

    @property
    def ready(self) -> bool:
        return self.links is not None

    def ranks_of(self, room: int) -> list[Rank]:
        """The prefill ranks that hold `room`'s KV: every TP rank of its DP rank."""
        assert self.setup is not None  # only called once ready (our own state)
        info = self.setup.info
        dp = prefill_dp_rank(info, room)
        return [(dp, tp) for tp in range(info.attn_tp_size)]

    def is_silent(self, now: float, dead_after_s: float) -> bool:
        return self.awaiting_since is not None and now - self.awaiting_since > dead_after_s

    def close(self) -> None:
        for job in (self.job, self.health):
            if job is not None:
                job.cancel()
        if self.links is not None:
            self.links.close()
            self.links = None


@dataclass(slots=True)
class SglangTransfer:
    """The SGLang side of one transfer: the ranks asked, those that succeeded, those that
    settled (a final KV_STATUS or an ABORT_ACK: they write no more), the first failure reason,
    the generation of our ABORT, and the bytes the transfer moves."""

    ranks: list[Rank] = field(default_factory=list)
    succeeded: set[int] = field(default_factory=set)  # prefill_rank = tp rank (pp = cp = 1)
    settled: set[int] = field(default_factory=set)
    failure: str | None = None
    generation: int = 0
    num_bytes: int = 0

    def record(self, msg: KVStatus | AbortAck, aborting: bool) -> bool:
        """Account one KV_STATUS or ABORT_ACK (an ack counts only for our latest ABORT, while
        `aborting`). False if its prefill rank is not one of ours (nothing recorded)."""
        rank = msg.prefill_rank
        if not 0 <= rank < len(self.ranks):
            return False
        if isinstance(msg, AbortAck):
            if aborting and msg.generation == self.generation:
                self.settled.add(rank)
        elif msg.status == Status.SUCCESS:
            self.succeeded.add(rank)
            self.settled.add(rank)
        elif msg.status == Status.FAILED:
            self.settled.add(rank)
            self.failure = self.failure or msg.reason or "prefill reported a failure (no reason)"
        return True

    @property
    def all_settled(self) -> bool:
        return len(self.settled) >= len(self.ranks)

    @property
    def all_succeeded(self) -> bool:
        return len(self.succeeded) >= len(self.ranks)

    def unsettled(self) -> list[Rank]:
        """The ranks that have not reported yet: the only ones an ABORT may still go to (a
        rank that reported, Failed above all, keeps its own cause on the prefill side)."""
        return [rank for rank in self.ranks if rank[1] not in self.settled]


class RoomIndex:
    """Room -> transfer id while the transfer is in the book (a room is one request's key on
    SGLang's wire), and the rooms finished lately with the prefill ranks (tp ranks) that had
    settled them: to tell a late status from an unknown one, and to ABORT none of those."""

    def __init__(self, max_finished: int = 4096) -> None:
        self._live: dict[int, int] = {}
        self._finished: OrderedDict[int, frozenset[int]] = OrderedDict()
        self._max_finished = max_finished

    def add(self, room: int, tid: int) -> bool:
        """False (nothing recorded) if the room is already in flight."""
        return self._live.setdefault(room, tid) == tid

    def get(self, room: int) -> int:
        return self._live.get(room, 0)

    def remove(self, room: int, tid: int, settled: frozenset[int] = frozenset()) -> None:
        """The transfer left the book; `settled`: its ranks that had reported (or acked)."""
        if self._live.get(room) == tid:
            del self._live[room]
            self._finished[room] = settled
            if len(self._finished) > self._max_finished:
                self._finished.popitem(last=False)

    def was_finished(self, room: int) -> bool:
        return room in self._finished

    def settled_after(self, room: int) -> frozenset[int]:
        """The ranks that had settled `room` when its transfer left the book (none if unknown)."""
        return self._finished.get(room, frozenset())
