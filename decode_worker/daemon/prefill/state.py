"""Book-keeping of the prefill peer: its decode peers, matching a room's two halves, and its page
free lists.

Plain records; the caller (`PrefillPeer`) holds its lock around every `Matcher` call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_worker.core.sampling import SamplingParams, TopLogprobs
from decode_worker.errors import FatalError, OutOfPages
from decode_worker.io.kv.protocol import RegionLayout, TransferRequest


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the HTTP side learns: the first token, or why the room failed."""

    room: int
    token_id: int | None
    logprob: float
    num_bytes: int
    error: str | None
    top_logprobs: TopLogprobs = field(default_factory=list)  # the first token's alternatives
    error_code: str | None = None  # the abort label of `error` (None: transfer_failed)
    # prompt tokens the decode side already held (the transfer's reused_len): the reuse a
    # gateway reads from the prefill's answer (smg's gRPC P/D mode does, as SGLang's prefill
    # reports its own prefix-cache hits there)
    reused_tokens: int = 0


OnDone = Callable[[PrefillResult], None]
MAX_RECENT_ROOMS = 4096  # rooms remembered to tell a late decode-side abort from an early one


@dataclass
class Decoder:
    """A decode peer that completed the handshake: its NIXL agent, its regions, when it was last
    heard from, and the rooms it asked for."""

    agent_name: str
    regions: dict[str, RegionLayout]
    last_seen: float
    rooms: set[int] = field(default_factory=set)


@dataclass(slots=True)
class RoomPrompt:
    """A room waiting for its other half, in either protocol: when it arrived, and its HTTP
    half (the prompt, the callback, the sampling of the first token), None until it comes."""

    room: int
    arrived_at: float
    prompt: list[int] | None = None
    on_done: OnDone | None = None
    sampling: SamplingParams | None = None


@dataclass(slots=True)
class Half(RoomPrompt):
    """One half that waits for its partner: a prompt (from HTTP) or a transfer request."""

    req: TransferRequest | None = None
    peer: bytes | None = None


@dataclass(frozen=True, slots=True)
class Job:
    """A matched room, ready for the compute thread."""

    peer: bytes
    req: TransferRequest
    prompt: list[int]
    on_done: OnDone | None
    sampling: SamplingParams | None = None  # None: greedy first token


class Matcher:
    """Pairs prompts with transfer requests by room; tracks running jobs for aborts."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.prompts: dict[int, Half] = {}
        self.requests: dict[int, Half] = {}
        self.running: dict[tuple[bytes, int], bool] = {}  # (peer, transfer id) -> aborted
        self.displaced: list[Half] = []
        self.jobs: dict[int, Job] = {}  # room -> its running job
        self.answered: set[int] = set()  # rooms of running jobs whose HTTP side was answered
        self.cancelled: dict[int, tuple[float, PrefillResult]] = {}  # room -> (when, answer)
        self.recent: OrderedDict[int, None] = OrderedDict()  # rooms that ran or were cancelled

    def add_prompt(
        self, room: int, prompt: list[int], on_done: OnDone | None, now: float,
        sampling: SamplingParams | None = None,
    ) -> Job | None:  # fmt: skip
        waiting = self.requests.pop(room, None)
        if waiting is None:
            self._displace(self.prompts.get(room))
            self.prompts[room] = Half(room, now, prompt, on_done, sampling=sampling)
            return None
        if waiting.req is None or waiting.peer is None:
            raise FatalError("matcher: a waiting request without its request")
        return self._start(waiting.peer, waiting.req, prompt, on_done, sampling)

    def add_request(self, peer: bytes, req: TransferRequest, now: float) -> Job | None:
        http = self.prompts.pop(req.room, None)
        if http is not None and http.prompt is not None:
            return self._start(peer, req, req.prompt_ids or http.prompt, http.on_done,
                               http.sampling)  # fmt: skip
        if req.prompt_ids is not None:
            return self._start(peer, req, req.prompt_ids, None)
        self._displace(self.requests.get(req.room))
        self.requests[req.room] = Half(req.room, now, req=req, peer=peer)
        return None

    def _displace(self, half: Half | None) -> None:
        if half is not None:
            self.displaced.append(half)

    def take_displaced(self) -> list[Half]:
        """Halves replaced by a newer half for the same room (to be failed by the caller)."""
        out, self.displaced = self.displaced, []
        return out

    def _start(
        self, peer: bytes, req: TransferRequest, prompt: list[int], on_done: OnDone | None,
        sampling: SamplingParams | None = None,
    ) -> Job:  # fmt: skip
        self.running[(peer, req.transfer_id)] = False
        job = self.jobs[req.room] = Job(peer, req, prompt, on_done, sampling)
        return job

    def abort(self, peer: bytes, transfer_id: int) -> bool:
        """True if the peer may be told now that nothing will be written (AbortAck)."""
        for room, half in list(self.requests.items()):
            if half.peer == peer and half.req is not None and half.req.transfer_id == transfer_id:
                del self.requests[room]
                return True
        key = (peer, transfer_id)
        if key in self.running:
            self.running[key] = True  # acked when the job's WRITEs have drained
            return False
        return True

    def is_aborted(self, job: Job) -> bool:
        return self.running.get((job.peer, job.req.transfer_id), False)

    def finish(self, job: Job) -> tuple[bool, bool]:
        """Forget a job: (aborted while running: its ack is due now, its HTTP side was already
        answered by `cancel`)."""
        room = job.req.room
        if self.jobs.get(room) is job:
            del self.jobs[room]
            self._remember(room)
        answered = room in self.answered
        self.answered.discard(room)
        return self.running.pop((job.peer, job.req.transfer_id), False), answered

    def cancel(self, room: int, answer: PrefillResult, now: float) -> tuple[str, OnDone | None]:
        """The decode side ended `room`'s request: (outcome, the HTTP callback to call with
        `answer` now). Outcomes: "answered" (a waiting prompt or a running job; the job still
        runs to free its pages), "early" (no prompt yet: it is answered `answer` on arrival,
        see `take_cancelled`), "late" (the room ran or was cancelled already: ignored)."""
        if room in self.recent or room in self.cancelled or room in self.answered:
            return "late", None
        half = self.prompts.pop(room, None)
        job = self.jobs.get(room)
        if half is None and job is None:
            if len(self.cancelled) >= MAX_RECENT_ROOMS:  # a flood of unknown rooms: oldest go
                del self.cancelled[next(iter(self.cancelled))]
            self.cancelled[room] = (now, answer)
            return "early", None
        self._remember(room)
        if job is not None:
            self.answered.add(room)
        return "answered", half.on_done if half is not None else job.on_done if job else None

    def take_cancelled(self, room: int) -> PrefillResult | None:
        """The answer for a prompt whose room the decode side already cancelled, or None."""
        entry = self.cancelled.pop(room, None)
        if entry is not None:
            self._remember(room)
        return entry[1] if entry is not None else None

    def _remember(self, room: int) -> None:
        self.recent[room] = None
        while len(self.recent) > MAX_RECENT_ROOMS:
            self.recent.popitem(last=False)

    def expire(self, now: float) -> list[Half]:
        """Remove and return the halves older than `timeout_s` (or their request deadline)."""
        out = []
        for table in (self.prompts, self.requests):
            for room, half in list(table.items()):
                limit = half.req.deadline_s if half.req is not None else self.timeout_s
                if now - half.arrived_at > limit:
                    out.append(table.pop(room))
        for room, (at, _) in list(self.cancelled.items()):
            if now - at > self.timeout_s:
                del self.cancelled[room]
        return out

    def drop_peer(self, peer: bytes) -> list[Half]:
        """Remove the waiting requests of a peer that went silent (nobody to answer)."""
        gone = [room for room, h in self.requests.items() if h.peer == peer]
        return [self.requests.pop(room) for room in gone]


class PageFreeList:
    """Page ids of the prefill peer's own pools; it holds a prompt's pages only while pushing."""

    def __init__(self, num_full_pages: int, num_swa_pages: int, has_swa: bool = True) -> None:
        """`has_swa` False (a model without sliding layers): SWA ids are all page 0, the
        dummy page, and none is held."""
        self.full = list(range(num_full_pages, 0, -1))
        self.swa = list(range(num_swa_pages, 0, -1))
        self.has_swa = has_swa

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """n pages from each pool. Raises OutOfPages (the request fails, nothing is taken)."""
        if not self.has_swa:
            return self._take_full(n), [0] * n
        if n > len(self.full) or n > len(self.swa):
            raise OutOfPages(
                f"prompt needs {n} pages per pool; prefill peer has {len(self.full)} full and "
                f"{len(self.swa)} swa free (raise cache.num_*_pages)"
            )
        full, swa = self.full[-n:][::-1], self.swa[-n:][::-1]
        del self.full[-n:], self.swa[-n:]
        return full, swa

    def _take_full(self, n: int) -> list[int]:
        if n > len(self.full):
            raise OutOfPages(f"prompt needs {n} pages; prefill peer has {len(self.full)} full "
                             "free (raise cache.num_full_pages)")
        full = self.full[-n:][::-1]
        del self.full[-n:]
        return full

    def give(self, full: list[int], swa: list[int]) -> None:
        self.full.extend(reversed(full))
        if self.has_swa:
            self.swa.extend(reversed(swa))
