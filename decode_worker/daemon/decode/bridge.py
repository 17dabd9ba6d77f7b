"""The only link between the event loop and the compute thread: typed commands and events.

The loop puts commands into the `Inbox`; the compute thread blocks on it when idle and drains it
without blocking when busy. The compute thread hands a whole step's events to the loop with one
`call_soon_threadsafe` (not one per token). Besides, once per step the engine publishes its
`Load` (a frozen value, swapped in whole) for GET /get_load, which the loop reads without a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decode_worker.core.sampling import SamplingParams
from decode_worker.io.api.backend import FlushResult, OutputChunk, SpecCounts
from decode_worker.io.kv_events.gate import AnswerGate


@dataclass(frozen=True, slots=True)
class AddRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None
    received_at: float
    top_logprobs: int = 0


@dataclass(frozen=True, slots=True)
class AbortRequest:
    rid: str
    reason: str


@dataclass(frozen=True, slots=True)
class FinishRequest:
    """The API layer matched a stop string: end `rid` as finished (its KV is cached)."""

    rid: str


@dataclass(frozen=True, slots=True)
class RefuseRequest:
    """Requests refused before they reached the engine (`DecodeBackend.refuse`): count
    `num_requests` aborts for `reason`, and end each room of `rooms` (prefill peer host,
    bootstrap port, room) at its peer with `reason` and `message`."""

    rooms: tuple[tuple[str, int, int], ...]
    reason: str
    message: str
    num_requests: int = 1


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop admitting; abort what is still queued or transferring after `grace_s`."""

    grace_s: float


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class FlushCache:
    """Evict every radix-tree entry no request holds, unless a request is running or waiting;
    answered with one `CacheFlushed` carrying the same `token`."""

    token: int


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What /server_info and /model_info report."""

    model_path: str
    served_model_name: str
    page_size: int
    window: int
    max_total_tokens: int
    max_running_requests: int
    kv_full_bytes_per_token: int  # all full-attention layers, K and V
    context_length: int  # longest sequence the model takes (max_position_embeddings)


Command = (AddRequest | AbortRequest | FinishRequest | RefuseRequest | Drain | Shutdown
           | FlushCache)
FINISH_REASONS = frozenset({"stop", "length"})  # the end reasons of a request that finished


@dataclass(frozen=True, slots=True)
class PromptTotals:
    """A request's prompt tokens, how many of them were cached (reused, not transferred) and
    how many of those the host tier restored: every chunk of its answer repeats them."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0

    def stamp(self, chunk: OutputChunk) -> OutputChunk:
        """`chunk` with these totals (the one place a chunk gets them)."""
        chunk.prompt_tokens, chunk.cached_tokens = self.prompt_tokens, self.cached_tokens
        chunk.host_cached_tokens = self.host_cached_tokens
        return chunk


@dataclass(slots=True)
class Tokens:
    """New tokens of request `rid` (the API layer's own `OutputChunk`, so nothing is translated
    on the loop) and its totals; the request's end follows as `Ended`."""

    rid: str
    chunk: OutputChunk
    totals: PromptTotals = PromptTotals()


@dataclass(slots=True)
class StepTokens:
    """One decode step's token for each of `rids` (rows without logprobs): one event per step,
    not one per request. The totals are those of the request's last `Tokens` (a request's first
    token always goes as `Tokens`)."""

    rids: list[str]
    token_ids: list[int]

    def split(self) -> list[Tokens]:
        """One `Tokens` per request (totals left at 0): for tests and tools."""
        return [Tokens(rid, OutputChunk([t])) for rid, t in zip(self.rids, self.token_ids,
                                                                 strict=True)]


@dataclass(slots=True)
class Ended:
    """Request `rid` ended: `reason` is "stop" or "length" when it finished, else its abort or
    failure label (docs/CONTRACTS.md; the API layer maps it to an HTTP status) with `message`.
    `matched_stop` is the stop token that finished it."""

    rid: str
    reason: str
    message: str = ""
    matched_stop: int | None = None
    totals: PromptTotals = PromptTotals()
    spec: SpecCounts | None = None  # speculative decoding's counts, when it drafted

    @property
    def finished(self) -> bool:
        return self.reason in FINISH_REASONS


@dataclass(slots=True)
class EngineDead:
    reason: str


@dataclass(slots=True)
class CacheFlushed:
    """The answer to `FlushCache(token)`."""

    token: int
    result: FlushResult


Event = Tokens | StepTokens | Ended | EngineDead | CacheFlushed


def per_request(events: list[Event]) -> list[Event]:
    """`events` with each `StepTokens` split into one `Tokens` per request (tests, tools)."""
    return [e for ev in events for e in (ev.split() if isinstance(ev, StepTokens) else [ev])]


class Inbox:
    """Commands from the loop to the compute thread (thread-safe, unbounded)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def put(self, cmd: Command) -> None:
        self._q.put(cmd)

    def get_all(self, timeout_s: float | None) -> list[Command]:
        """Block up to `timeout_s` for the first command (0 = don't block), then drain the rest."""
        cmds: list[Command] = []
        try:
            if timeout_s is None or timeout_s > 0:
                cmds.append(self._q.get(timeout=timeout_s))
            while True:
                cmds.append(self._q.get_nowait())
        except queue.Empty:
            pass
        return cmds


@dataclass
class Outbox:
    """Events from the compute thread to the loop, delivered in one batch per step. An outbox
    built `unbound()` (before the loop runs) keeps its events until a bound one replaces it.

    With a `gate` (the ZMQ publisher's `AnswerGate`), a batch holding an answer (`Ended`, or a
    flush's `CacheFlushed`) goes to the loop only once the publisher has sent the KV-event
    batches appended before it, and the batches after it keep their order (`io/kv_events/
    gate.py`); the compute thread never waits for it."""

    loop: asyncio.AbstractEventLoop | None
    deliver: Callable[[list[Event]], Any]
    _pending: list[Event] = field(default_factory=list)
    gate: AnswerGate | None = None
    _final: bool = False  # `_pending` holds an answer

    @classmethod
    def unbound(cls) -> Outbox:
        return cls(None, lambda events: None)

    def put(self, event: Event) -> None:
        self._pending.append(event)
        if isinstance(event, Ended | CacheFlushed):
            self._final = True

    def flush(self) -> None:
        gate = self.gate
        if gate is not None:
            gate.release_overdue()
        if not self._pending or self.loop is None:
            return
        batch, self._pending = self._pending, []
        final, self._final = self._final, False
        loop, deliver = self.loop, self.deliver

        def send() -> None:
            # A closed loop means we are shutting down and nobody is listening.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, batch)

        if gate is None:
            send()
        else:
            gate.run_after(send, final=final)
