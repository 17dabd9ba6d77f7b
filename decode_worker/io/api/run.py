"""Driving one generation: the backend's chunks -> tokens, text, stop strings, latency metrics.

`GenerationRun` is shared by the three generation endpoints. `start()` awaits the first chunk,
so errors the backend raises early (4xx, 503) become plain HTTP errors; after that, failures
arrive as a `Step` with `error` set. A stop string ends the run once the backend has ended the
request too (`backend.finish`, then its last chunk), so its answer follows the request's KV
events. If the consumer stops before the last step (the client
went away), the run aborts the request with "client_abort" and closes the backend iterator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from decode_worker.core.sampling import TopLogprobs
from decode_worker.errors import DecodeWorkerError
from decode_worker.io.api.backend import GenerateBackend, GenerateInput, OutputChunk, SpecCounts
from decode_worker.io.api.textgen import TextStream
from decode_worker.io.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Finish:
    """How a request ended. `reason` is stop / length / abort / error."""

    reason: str
    matched: int | str | None = None
    message: str | None = None
    status: int = 500
    code: str = "internal"

    def sglang(self, completion_tokens: int) -> dict[str, Any] | None:
        """SGLang's `meta_info.finish_reason` object."""
        if self.reason == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.reason == "length":
            return {"type": "length", "length": completion_tokens}
        return {"type": "abort", "message": self.message or self.code}


@dataclass(slots=True)
class Step:
    """What one backend chunk added."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish: Finish | None = None
    top_logprobs: list[TopLogprobs] = field(default_factory=list)


class BackendEnded(DecodeWorkerError):
    """The backend's iterator ended without a finished chunk."""


class RejectedAtStart(DecodeWorkerError):
    """The backend's first chunk was an error with no tokens: nothing was generated, so the
    request is answered with that chunk's HTTP status (streams too), not a 200 stream."""

    def __init__(self, message: str, status: int, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class GenerationRun:
    """One request in flight. Use: `await run.start()`, then `async for step in run.steps()`."""

    def __init__(
        self, backend: GenerateBackend, inp: GenerateInput, metrics: Metrics | None = None
    ) -> None:
        self.backend = backend
        self.inp = inp
        self.metrics = metrics
        sp = inp.sampling
        self.text = TextStream(backend.tokenizer, sp.stop, sp.no_stop_trim,
                               sp.skip_special_tokens)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []  # when inp.top_logprobs
        self.prompt_tokens = len(inp.input_ids)
        self.cached_tokens = 0
        self.host_cached_tokens = 0  # the part of cached_tokens restored from the host tier
        self.spec: SpecCounts | None = None  # speculative decoding's counts (the last chunk's)
        self.finish: Finish | None = None
        self._iter: AsyncIterator[OutputChunk] | None = None
        self._first: OutputChunk | None = None
        self._last_token_at: float | None = None
        self._closed = False

    async def start(self) -> None:
        """Submit and wait for the first chunk. Raises what the backend raises (no abort then)."""
        self._iter = self.backend.generate(self.inp)
        try:
            self._first = await anext(self._iter)
        except StopAsyncIteration:
            self._closed = True
            await self._close_iter()
            raise BackendEnded("backend produced no output") from None
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the client went away while waiting
                self.backend.abort(self.inp.rid, "client_abort")
            self._closed = True
            await self._close_iter()
            raise

    async def reject_if_failed_at_start(self) -> None:
        """After `start()`: if the first chunk is an error without tokens, end the run (no
        abort: the backend already ended it) and raise RejectedAtStart."""
        first = self._first
        if first is None or first.error is None or first.token_ids:
            return
        self.prompt_tokens = first.prompt_tokens or self.prompt_tokens
        self.finish = Finish("error", message=first.error, status=first.status,
                             code=first.error_code)
        await self.close()
        raise RejectedAtStart(first.error, first.status, first.error_code)

    async def steps(self) -> AsyncGenerator[Step, None]:
        """Steps until the finishing one (inclusive). Closing early aborts the request."""
        assert self._iter is not None and self._first is not None, "start() first"
        chunk: OutputChunk | None = self._first
        try:
            while chunk is not None:
                step = self._consume(chunk)
                if step.finish is not None:
                    self.finish = step.finish
                    if self.text.stopped and chunk.finish_reason is None:
                        await self._backend_end()
                yield step
                if self.finish is not None:
                    return
                chunk = await anext(self._iter, None)
            self.finish = Finish("error", message="backend ended without finishing")
            yield Step("", [], finish=self.finish)
        finally:
            await self.close()

    async def _backend_end(self) -> None:
        """A stop string ended the run before the backend knew (`_consume` told it): wait for
        the backend's own end of the request, dropping the tokens it made meanwhile. The decode
        engine ends it at its next step, its KV cached in the tree and the step's KV events
        published, so this answer never leaves before them (a router then sees the cache the
        client's next turn will hit). Bounded by the engine's step (a dead engine ends it)."""
        assert self._iter is not None
        async for chunk in self._iter:
            if chunk.finish_reason is not None or chunk.error is not None:
                return

    async def close(self) -> None:
        """End the run: abort it ("client_abort") unless it finished; idempotent."""
        if self.finish is None and not self._closed:
            log.info("rid=%s: client went away, aborting", self.inp.rid)
            self.backend.abort(self.inp.rid, "client_abort")
        if not self._closed:
            self._closed = True
            await self._close_iter()

    async def _close_iter(self) -> None:
        aclose = getattr(self._iter, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

    def _consume(self, chunk: OutputChunk) -> Step:
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.cached_tokens = chunk.cached_tokens
        self.host_cached_tokens = chunk.host_cached_tokens
        self.spec = chunk.spec or self.spec
        if chunk.error is not None:
            return Step(self.text.finish(), [], finish=Finish(
                "error", message=chunk.error, status=chunk.status, code=chunk.error_code))
        ids = list(chunk.token_ids)
        self._observe_tokens(len(ids))
        self.output_ids += ids
        self.logprobs += list(chunk.logprobs or ())
        self.top_logprobs += list(chunk.top_logprobs or ())
        text = self.text.push(self._text_ids(chunk, ids))
        if self.text.stopped:
            self.backend.finish(self.inp.rid)
            return self._finished(text, ids, chunk, Finish("stop", matched=self.text.matched))
        if chunk.finish_reason is not None:
            text += self.text.finish()
            end = Finish(chunk.finish_reason, matched=chunk.matched_stop, code="abort")
            return self._finished(text, ids, chunk, end)
        return _step(text, ids, chunk)

    def _text_ids(self, chunk: OutputChunk, ids: list[int]) -> list[int]:
        """Token ids to render: a matched stop token is not shown unless `no_stop_trim`."""
        stop = chunk.matched_stop
        trim = chunk.finish_reason == "stop" and isinstance(stop, int) and not isinstance(
            stop, bool)
        if trim and ids and ids[-1] == stop and not self.inp.sampling.no_stop_trim:
            return ids[:-1]
        return ids

    def _finished(self, text: str, ids: list[int], chunk: OutputChunk, end: Finish) -> Step:
        if self.metrics is not None and self.inp.received_at:
            self.metrics.observe_e2e(time.monotonic() - self.inp.received_at)
        return _step(text, ids, chunk, end)

    def _observe_tokens(self, n: int) -> None:
        if self.metrics is None or n == 0:
            return
        now = time.monotonic()
        if self._last_token_at is None:
            if self.inp.received_at:
                self.metrics.observe_ttft(now - self.inp.received_at)
        else:
            gap = (now - self._last_token_at) / n
            for _ in range(n):
                self.metrics.observe_itl(gap)
        self._last_token_at = now

    def output_token_logprobs(self) -> list[list[Any]]:
        """SGLang's `[logprob, token_id, null]` triples."""
        return [[lp, tid, None] for lp, tid in zip(self.logprobs, self.output_ids, strict=False)]

    def output_top_logprobs(self) -> list[list[list[Any]]]:
        """SGLang's per-token lists of `[logprob, token_id, null]`, most likely first."""
        return [[[lp, tid, None] for tid, lp in top] for top in self.top_logprobs]


def _step(text: str, ids: list[int], chunk: OutputChunk, end: Finish | None = None) -> Step:
    return Step(text, ids, list(chunk.logprobs or ()), end, list(chunk.top_logprobs or ()))
