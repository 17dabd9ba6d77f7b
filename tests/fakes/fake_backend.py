"""A scripted `GenerateBackend` and a byte-level tokenizer, for the HTTP/API tests only.

Also `ServerThread`: an HttpServer on its own event loop in a background thread, so tests can
use blocking clients (httpx, raw sockets) against it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from decode_worker.daemon.shared.http_server import HttpServer, ServerConfig
from decode_worker.io.api.backend import FlushResult, GenerateInput, Health, Load, OutputChunk
from decode_worker.io.api.message import Handler
from decode_worker.io.api.targets import Target

EOS = 256


class ByteTokenizer:
    """Token id = byte value; 256 is EOS. Decoding replaces incomplete UTF-8 with U+FFFD."""

    eos_token_ids: Sequence[int] = (EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            tools: list[dict[str, Any]] | None = None,
                            start_date: Any = None, reasoning_effort: str | None = None) -> str:
        """A template that renders no tools (as the built-in fallback template)."""
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return turns + "<assistant>"


@dataclass
class FakeBackend:
    """Replies with `reply` (cycled) one chunk of `chunk_tokens` tokens per `delay_s`.

    Ends with "length" at max_new_tokens, or, with `eos_at_end`, emits EOS after the reply and
    ends with "stop". `error_after` tokens -> an error chunk. `start_error` is raised by
    generate(). Records inputs, aborts, finishes and closed iterators. `load_state` is what
    /get_load reports; `flush_results` are the answers of successive flushes (the last one
    repeats; empty: success), `flushes` counts them.
    """

    reply: bytes = b"Hello, world!"
    chunk_tokens: int = 1
    delay_s: float = 0.0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, restored from the host tier
    eos_at_end: bool = False
    error_after: int | None = None
    start_error: Exception | None = None
    health_state: Health = field(default_factory=Health)
    load_state: Load = field(default_factory=Load)
    flush_results: list[FlushResult] = field(default_factory=list)
    flushes: int = 0
    model_path: str = "/nonexistent"
    server_extra: dict[str, Any] = field(default_factory=dict)  # more /server_info fields
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    inputs: list[GenerateInput] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    refused: list[tuple[list[Target], str, str]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def generate(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        self.inputs.append(inp)
        if self.start_error is not None:
            raise self.start_error
        return self._run(inp)

    def _script(self, inp: GenerateInput) -> tuple[list[int], str, int | None]:
        limit = inp.sampling.max_new_tokens
        if self.eos_at_end and len(self.reply) < limit:
            return [*self.reply, EOS], "stop", EOS
        cycled = (self.reply * (limit // max(1, len(self.reply)) + 1))[:limit]
        return list(cycled), "length", None

    async def _run(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        tokens, reason, matched = self._script(inp)
        try:
            for start in range(0, max(1, len(tokens)), self.chunk_tokens):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self.error_after is not None and start >= self.error_after:
                    yield OutputChunk(prompt_tokens=len(inp.input_ids), error="scripted failure",
                                      error_status=500, error_code="transfer_failed")
                    return
                if inp.rid in self.finished:  # a stop string: end at once, as the engine
                    yield OutputChunk(finish_reason="stop", prompt_tokens=len(inp.input_ids),
                                      cached_tokens=self.cached_tokens,
                                      host_cached_tokens=self.host_cached_tokens)
                    return
                ids = tokens[start : start + self.chunk_tokens]
                last = start + self.chunk_tokens >= len(tokens)
                yield OutputChunk(
                    token_ids=ids, logprobs=[-0.5] * len(ids) if inp.return_logprob else None,
                    finish_reason=reason if last else None,  # type: ignore[arg-type]
                    matched_stop=matched if last else None, prompt_tokens=len(inp.input_ids),
                    cached_tokens=self.cached_tokens, host_cached_tokens=self.host_cached_tokens,
                    top_logprobs=[[(t + k, -0.5 - k) for k in range(inp.top_logprobs)]
                                  for t in ids] if inp.top_logprobs else None)
        finally:
            self.closed.append(inp.rid)

    def abort(self, rid: str, reason: str) -> None:
        self.aborts.append((rid, reason))

    def finish(self, rid: str) -> None:
        self.finished.append(rid)

    def refuse(self, targets: Sequence[Target], reason: str, message: str) -> None:
        self.refused.append((list(targets), reason, message))

    def health(self) -> Health:
        return self.health_state

    def load(self) -> Load:
        return self.load_state

    async def flush_cache(self) -> FlushResult:
        self.flushes += 1
        if not self.flush_results:
            return FlushResult(True)
        return self.flush_results.pop(0) if len(self.flush_results) > 1 else self.flush_results[0]

    def server_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tp_size": 1, "dp_size": 1,
                "disaggregation_mode": "decode", "context_length": 4096, **self.server_extra}

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True}


class ServerThread:
    """Run an HttpServer on a private loop in a daemon thread. Use as a context manager."""

    def __init__(self, handler: Handler, config: ServerConfig | None = None,
                 uvloop: bool = False) -> None:
        if uvloop:
            import uvloop as uv

            self.loop: asyncio.AbstractEventLoop = uv.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.server = HttpServer(handler, config or ServerConfig(port=0))
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self.call(self.server.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.server.close(grace_s=1.0))
        self.call(self.loop.shutdown_asyncgens())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
