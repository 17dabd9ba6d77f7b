"""Pieces every endpoint uses: the API config, prompt checks, SSE framing, error bodies, the
cached-token split."""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from decode_worker.errors import ClientError, RequestTooLarge
from decode_worker.io.api.run import GenerationRun

_JSON = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
Clock = Callable[[], datetime.datetime]


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def utc_today(clock: Clock = utc_now) -> datetime.date:
    """The date in UTC by `clock` (read once, when a config is built)."""
    return clock().astimezone(datetime.UTC).date()


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """What the API layer needs from settings (the daemon builds it; see `from_settings`).

    `api_key`, when set, is required as `Authorization: Bearer <key>` on the generation
    endpoints, /v1/models and /flush_cache; health, info, load and metrics stay open (the
    router and Prometheus probe them without credentials). `default_max_new_tokens` applies only
    when the backend reports no `context_length` (else `limits.py` decides); `served_model_name`
    unset means the backend's model path. `system_start_date` is the date chat templates get
    from `strftime_now` (`api.system_start_date`, default the UTC date when the config was
    built, i.e. at start-up): fixed for the process so that the prefill and the decode server
    render a request alike even across midnight.
    """

    served_model_name: str | None = None
    max_prompt_tokens: int | None = None
    default_max_new_tokens: int = 128
    api_key: str | None = None
    metrics_enabled: bool = True
    observe_latency: bool = True
    strict_model_name: bool = True  # a request naming another model is a 404
    reasoning_parser: str = "auto"  # chat: auto / gpt-oss / none (io/api/harmony/chat.py)
    tool_call_parser: str = "auto"
    # keys /server_info reports unless the backend reports them itself (the cache settings)
    server_info_defaults: dict[str, Any] = field(default_factory=dict)
    system_start_date: datetime.date = field(default_factory=utc_today)

    @classmethod
    def from_settings(cls, settings: Any, clock: Clock = utc_now) -> ApiConfig:
        """From a `decode_worker.settings.Settings` (duck-typed: io does not import settings).
        `clock` gives the start date when `api.system_start_date` is unset (read once, here)."""
        key = settings.server.api_key
        return cls(
            served_model_name=settings.model.served_model_name,
            max_prompt_tokens=settings.scheduler.max_prompt_tokens,
            default_max_new_tokens=settings.scheduler.default_max_new_tokens,
            api_key=key.get_secret_value() if key is not None else None,
            metrics_enabled=settings.metrics.enabled,
            strict_model_name=settings.api.strict_model_name,
            reasoning_parser=settings.api.reasoning_parser,
            tool_call_parser=settings.api.tool_call_parser,
            server_info_defaults={**cache_info(settings), **speculative_info(settings)},
            system_start_date=settings.api.system_start_date or utc_today(clock),
        )


def speculative_info(settings: Any) -> dict[str, Any]:
    """The speculative settings under SGLang's server_info keys (`speculative_algorithm`,
    `speculative_num_draft_tokens`, ...; `SpeculativeSettings.server_info`)."""
    return dict(settings.speculative.server_info())


def cache_info(settings: Any) -> dict[str, Any]:
    """The decode cache settings under SGLang's server_info keys (`disable_radix_cache`,
    `disaggregation_decode_enable_radix_cache`, `enable_hierarchical_cache`, `hicache_ratio`,
    `hicache_size`: GB, 0 = sized by the ratio, as SGLang's `--hicache-size`;
    `hicache_write_policy`) and `enable_unified_radix_tree`."""
    c = settings.cache
    radix = bool(c.decode_radix_cache)
    hicache = radix and (c.hierarchical_cache is None or bool(c.hierarchical_cache))
    return {"disable_radix_cache": not radix, "disaggregation_decode_enable_radix_cache": radix,
            "enable_unified_radix_tree": radix and bool(c.unified_radix_tree),
            "enable_hierarchical_cache": hicache, "hicache_ratio": c.hicache_ratio,
            "hicache_size": c.hicache_size_gb or 0, "hicache_write_policy": c.hicache_write_policy}


def check_prompt(
    ids: Sequence[int], max_prompt_tokens: int | None, vocab_size: int | None = None
) -> list[int]:
    """Validate a tokenized prompt. Raises ClientError (empty, negative ids, ids outside the
    vocabulary when `vocab_size` is known: the model would index past its embedding) or
    RequestTooLarge."""
    if not ids:
        raise ClientError("the prompt is empty")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise RequestTooLarge(
            f"the prompt has {len(ids)} tokens; this worker accepts at most {max_prompt_tokens}"
        )
    if min(ids) < 0:
        raise ClientError("input_ids must be non-negative token ids")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ClientError(f"input_ids: token id {max(ids)} is outside the vocabulary "
                          f"(size {vocab_size})")
    return list(ids)


def vocab_size_of(tokenizer: object) -> int | None:
    """The size input ids are checked against, if the tokenizer reports one: the model's
    embedding rows (`input_vocab_size`, config.json's vocab_size), else `vocab_size`."""
    size = getattr(tokenizer, "input_vocab_size", None) or getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def new_rid() -> str:
    return uuid.uuid4().hex


def now_s() -> int:
    return int(time.time())


# Characters JSON may carry raw inside a string but `str.splitlines` (and clients that split an
# SSE stream with it, such as httpx's `iter_lines`) takes for line ends: NEL, LINE SEPARATOR,
# PARAGRAPH SEPARATOR in UTF-8. msgspec escapes the ASCII control characters already.
_LINE_ENDS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
              (b"\xe2\x80\xa9", b"\\u2029"))


def json_line(obj: Any) -> bytes:
    """`obj` as JSON on one line for every line splitter: the Unicode line ends a generated
    text may hold are written as JSON escapes (the same string once decoded)."""
    raw = _JSON.encode(obj)
    for char, escaped in _LINE_ENDS:
        if char in raw:  # UTF-8 is self-synchronising: these bytes are only that character
            raw = raw.replace(char, escaped)
    return raw


def sse(obj: Any) -> bytes:
    return b"data: " + json_line(obj) + b"\n\n"


def error_obj(message: str, status: int, code: str) -> dict[str, Any]:
    """The `{"error": {...}}` object; `type` says the class of error, `code` the status."""
    return {"error": {"message": message, "type": error_type(status), "code": status,
                      "reason": code}}


def error_type(status: int) -> str:
    return {
        400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
        405: "method_not_allowed", 413: "request_too_large", 503: "service_unavailable",
    }.get(status, "internal_error" if status >= 500 else "invalid_request_error")


async def collect(run: GenerationRun) -> GenerationRun:
    """Consume every step of a non-streaming run; the run's totals hold the result."""
    steps = run.steps()
    try:
        async for _ in steps:
            pass
    finally:
        await steps.aclose()
    return run



class RunStream:
    """The SSE body of a request's runs (one per sample). Closing it ends every run even if no
    byte was produced yet (an async generator closed before its first step never runs its
    `finally`)."""

    def __init__(self, chunks: AsyncGenerator[bytes, None],
                 runs: Sequence[GenerationRun]) -> None:
        self._chunks = chunks
        self._runs = list(runs)

    def __aiter__(self) -> RunStream:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            for run in self._runs:
                await run.close()


def cached_tokens_details(cached_tokens: int, host_cached_tokens: int) -> dict[str, int] | None:
    """SGLang's `meta_info.cached_tokens_details`: where the cached prompt tokens came from,
    `{"device": cached - host, "host": host}`; None when nothing was cached (SGLang reports it
    so with or without its host tier: `{"device": cached, "host": 0}` when off)."""
    if cached_tokens <= 0:
        return None
    host = min(max(host_cached_tokens, 0), cached_tokens)
    return {"device": cached_tokens - host, "host": host}
