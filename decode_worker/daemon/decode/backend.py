"""The decode worker's `GenerateBackend`: the event-loop side of the engine.

Runs on the event loop thread only. `generate` posts an `AddRequest` to the compute thread and
yields the chunks that `deliver` routes to the request's queue; closing the iterator early
aborts the request, so every request ends in the engine exactly once. `flush_cache` posts a
`FlushCache` and awaits its `CacheFlushed`; `load` reads what the engine published last.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from decode_worker.daemon.decode.bridge import (
    AbortRequest,
    AddRequest,
    BackendInfo,
    CacheFlushed,
    Ended,
    EngineDead,
    Event,
    FinishRequest,
    FlushCache,
    Inbox,
    PromptTotals,
    RefuseRequest,
    StepTokens,
    Tokens,
)
from decode_worker.device.grammar import prepare_sampling
from decode_worker.errors import ClientError, Draining, QueueFull, ServiceUnavailable
from decode_worker.io.api.backend import (
    FlushResult,
    GenerateInput,
    Health,
    Load,
    OutputChunk,
    Tokenizer,
)
from decode_worker.io.api.targets import Target
from decode_worker.io.kv_events.hub import KvEventHub

log = logging.getLogger(__name__)


class LoadSource(Protocol):
    """The engine's books: `load` is replaced whole at every step (read without a lock)."""

    load: Load


FLUSH_WAIT_S = 10.0  # an engine that does not answer a flush within this is stuck: 503


class DecodeBackend:
    """Bridges HTTP requests to the compute thread (see module docstring)."""

    def __init__(self, inbox: Inbox, tokenizer: Tokenizer, info: BackendInfo,
                 max_queued: int, default_bootstrap_port: int, *, loads: LoadSource,
                 kv_events: KvEventHub | None = None,
                 kv_events_info: dict[str, Any] | None = None,
                 host_tier_info: Callable[[], dict[str, Any]] | None = None) -> None:
        """`loads.load` is the engine's latest published `Load` (read, never waited for);
        `kv_events`: the engine's KV-event log (None: events off), read by in-process (gRPC)
        subscribers; `kv_events_info`: /server_info's `kv_events` (SGLang's);
        `host_tier_info`: /server_info's `host_tier` (the engine's last published)."""
        self._inbox = inbox
        self.default_bootstrap_port = default_bootstrap_port
        self._tokenizer = tokenizer
        self.info = info
        self.max_queued = max_queued
        self._loads = loads
        self._queues: dict[str, asyncio.Queue[OutputChunk]] = {}
        self._waiting: set[str] = set()  # rids in `_queues` not yet given a token (queued)
        self._totals: dict[str, PromptTotals] = {}  # rid -> the totals last sent
        self._flushes: dict[int, asyncio.Future[FlushResult]] = {}
        self._flush_tokens = itertools.count(1)
        self.announcing = False  # the drain's announce window: /health 503, work still taken
        self.draining = False  # new work refused
        self.dead_reason: str | None = None
        self.kv_events, self.kv_events_info = kv_events, kv_events_info
        self.host_tier_info = host_tier_info or (lambda: {"enabled": False})

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def num_active(self) -> int:
        return len(self._queues)

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet decoding (no token yet): waiting for their peer's
        protocol, for pages in the prealloc queue, or for their KV. `max_queued` bounds it."""
        return len(self._waiting)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        self._check_can_accept(inp)
        if inp.sampling.grammar is not None:  # compiled off the loop, cached; bad: 400
            inp.sampling = await asyncio.to_thread(prepare_sampling, self._tokenizer, inp.sampling)
        queue: asyncio.Queue[OutputChunk] = asyncio.Queue()
        self._queues[inp.rid] = queue
        self._waiting.add(inp.rid)
        self._inbox.put(AddRequest(
            rid=inp.rid, input_ids=list(inp.input_ids), sampling=inp.sampling,
            return_logprob=inp.return_logprob, bootstrap_host=inp.bootstrap_host,
            bootstrap_port=inp.bootstrap_port or self.default_bootstrap_port,
            bootstrap_room=inp.bootstrap_room,
            received_at=inp.received_at,
            top_logprobs=inp.top_logprobs,
        ))
        ended = False
        try:
            while not ended:
                chunk = await queue.get()
                ended = chunk.finish_reason is not None or chunk.error is not None
                yield chunk
        finally:
            self._queues.pop(inp.rid, None)
            self._waiting.discard(inp.rid)
            self._totals.pop(inp.rid, None)
            if not ended:  # the consumer went away first
                self._inbox.put(AbortRequest(inp.rid, "client_abort"))

    def abort(self, rid: str, reason: str) -> None:
        if rid in self._queues:
            self._inbox.put(AbortRequest(rid, reason))

    def finish(self, rid: str) -> None:
        if rid in self._queues:
            self._inbox.put(FinishRequest(rid))

    def refuse(self, targets: Sequence[Target], reason: str, message: str) -> None:
        """`GenerateBackend.refuse`: one `RefuseRequest` to the engine, which counts the
        refusal and ends each target's room at its prefill peer (`RequestTable.refuse`). A
        target without a port gets `transfer.bootstrap_port`. Never raises, never blocks."""
        rooms = tuple((t.host, t.port or self.default_bootstrap_port, t.room) for t in targets
                      if t.host and t.room is not None)
        self._inbox.put(RefuseRequest(rooms, reason, message, max(1, len(targets))))

    def load(self) -> Load:
        return self._loads.load

    async def flush_cache(self) -> FlushResult:
        """Raises ServiceUnavailable when the engine is dead or does not answer in time."""
        if self.dead_reason is not None:
            raise ServiceUnavailable(f"engine stopped: {self.dead_reason}")
        token = next(self._flush_tokens)
        done: asyncio.Future[FlushResult] = asyncio.get_running_loop().create_future()
        self._flushes[token] = done
        self._inbox.put(FlushCache(token))
        try:
            return await asyncio.wait_for(done, FLUSH_WAIT_S)
        except TimeoutError:
            raise ServiceUnavailable(f"the engine did not answer the flush in "
                                     f"{FLUSH_WAIT_S:g}s") from None
        finally:
            self._flushes.pop(token, None)

    def deliver(self, events: list[Event]) -> None:
        """Called on the loop (via call_soon_threadsafe) with one engine step's events. A
        finished request's last tokens and its `Ended` come in the same step: they become one
        chunk (not yet read: the consumer runs after this batch)."""
        last: dict[str, OutputChunk] = {}  # this batch's latest chunk per request
        for event in events:
            if isinstance(event, EngineDead):
                self._on_engine_dead(event.reason)
            elif isinstance(event, CacheFlushed):
                done = self._flushes.get(event.token)
                if done is not None and not done.done():  # else: the caller gave up
                    done.set_result(event.result)
            elif isinstance(event, StepTokens):
                totals, none = self._totals, PromptTotals()
                for rid, token in zip(event.rids, event.token_ids, strict=True):
                    step_chunk = totals.get(rid, none).stamp(OutputChunk([token]))
                    last[rid] = step_chunk
                    self._put(rid, step_chunk)
            elif isinstance(event, Tokens):  # a request's first token always comes so
                chunk = event.totals.stamp(event.chunk)
                last[event.rid] = chunk
                self._waiting.discard(event.rid)
                if event.rid in self._queues:
                    self._totals[event.rid] = event.totals
                self._put(event.rid, chunk)
            else:
                end = last.get(event.rid) if event.finished else None
                if end is None:  # an error goes alone: the tokens before it stay tokens
                    end = OutputChunk()
                    self._put(event.rid, end)
                _end_chunk(end, event)

    def _put(self, rid: str, chunk: OutputChunk) -> None:
        queue = self._queues.get(rid)
        if queue is not None:  # else: the client left and the abort is on its way
            queue.put_nowait(chunk)

    def health(self) -> Health:
        if self.dead_reason is not None:
            return Health("unhealthy", f"engine stopped: {self.dead_reason}")
        if self.draining:
            return Health("draining", "draining: not accepting new requests")
        if self.announcing:
            return Health("draining", "draining soon: still serving, send new requests "
                          "elsewhere", still_serving=True)
        return Health("ok")

    def server_info(self) -> dict[str, Any]:
        """The API layer adds `served_model_name` and the cache flags (from settings)."""
        i = self.info
        return {
            "model_path": i.model_path, "tokenizer_path": i.model_path,
            "disaggregation_mode": "decode", "disaggregation_transfer_backend": "nixl",
            "tp_size": 1, "dp_size": 1, "page_size": i.page_size, "sliding_window": i.window,
            "max_total_num_tokens": i.max_total_tokens,
            "max_running_requests": i.max_running_requests, "status": self.health().status,
            "kv_full_bytes_per_token": i.kv_full_bytes_per_token,
            "context_length": i.context_length, "kv_events": self.kv_events_info,
            "host_tier": self.host_tier_info(),
        }

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.info.model_path, "tokenizer_path": self.info.model_path,
                "is_generation": True, "context_length": self.info.context_length}

    def _check_can_accept(self, inp: GenerateInput) -> None:
        health = self.health()
        if not health.accepts_work:
            if health.status == "draining":
                raise Draining(health.message)
            raise ServiceUnavailable(health.message)
        if (inp.bootstrap_host is None) != (inp.bootstrap_room is None):
            raise ClientError("bootstrap_host and bootstrap_room go together: give both (the "
                              "prefill peer's address and the transfer room) or neither")
        if inp.rid in self._queues:
            raise ClientError(f"rid {inp.rid!r} is already running")
        if len(self._waiting) >= self.max_queued:
            raise QueueFull(f"queue full ({self.max_queued} requests waiting to start): "
                            "retry later")

    def _on_engine_dead(self, reason: str) -> None:
        self.dead_reason = reason
        for done in self._flushes.values():
            if not done.done():
                done.set_exception(ServiceUnavailable(f"engine stopped: {reason}"))
        for rid, queue in self._queues.items():
            queue.put_nowait(OutputChunk(error=f"engine stopped: {reason}", error_status=503,
                                         error_code="internal"))
            log.error("rid=%s failed: engine stopped", rid)


def _end_chunk(chunk: OutputChunk, ended: Ended) -> None:
    """Make `chunk` the request's last: finished ("stop" / "length") or an error whose reason
    the API layer maps to an HTTP status."""
    ended.totals.stamp(chunk)
    chunk.spec = ended.spec
    if ended.finished:
        chunk.finish_reason = "stop" if ended.reason == "stop" else "length"
        chunk.matched_stop = ended.matched_stop
    else:
        chunk.error = ended.message or f"aborted: {ended.reason}"
        chunk.error_code = ended.reason
