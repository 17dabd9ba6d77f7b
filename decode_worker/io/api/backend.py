"""The seam between the HTTP API and whatever generates tokens (decode worker, prefill peer).

Division of work:
- The API layer parses and validates requests, tokenizes (`text` -> ids, chat messages -> the
  tokenizer's chat template -> ids), checks `max_prompt_tokens`, detokenizes incrementally,
  and applies **stop strings** on the text (the backend never sees text). When a stop string
  matches it calls `backend.finish(rid)` and reads the iterator to its last chunk (dropping
  the tokens made meanwhile) before it answers: `finish` must make the backend end the
  request soon (the decode backend: at the engine's next step, once the KV is cached and its
  events are published).
- The backend judges **stop token ids, EOS and max_new_tokens** and reports them in
  `OutputChunk.finish_reason`; it owns pages, queues, transfers and the device.

Iterator contract of `generate`: chunks in order; the last one has `finish_reason` set (or
`error`). If the consumer stops early it first calls `abort(rid, reason)` (client gone:
"client_abort") or `finish(rid)` (stop string), then `aclose()`s / cancels the iterator, which
must then release everything the request held. `abort` and `finish` are idempotent and may be
called for an rid that has already ended. All methods are called on the event loop thread and
must not block it. `GenerateInput.rid` is unique among the requests in flight (the API layer
suffixes a client rid that is already live: router retries resend the same rid).

How chunks become HTTP answers:
- raised before the first chunk: `ClientError` -> its status (400/413), `ServiceUnavailable`
  -> 503 + Retry-After, `AdmissionRejected` -> 413, anything else -> 500; same for streams;
- a first chunk with `error` and no tokens (e.g. the engine's admission says too large):
  answered like a raised error, `OutputChunk.status` with the JSON error body, streams too;
- a later chunk with `error`: non-streaming -> `OutputChunk.status` with the JSON error body;
  streaming -> an SSE `data: {"error": ...}` event, then `data: [DONE]` (already 200);
- `finish_reason="abort"` without `error`: a normal 200 answer whose finish reason is abort;
- `finish_reason="stop"` with `matched_stop` = a token id (EOS or a stop token): that last
  token is left out of the text (kept in `output_ids`) unless `no_stop_trim`.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from decode_worker.core.sampling import SamplingParams, TopLogprobs

if TYPE_CHECKING:
    from decode_worker.io.api.targets import Target

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class GenerateInput:
    """One validated generation request, already tokenized.

    `bootstrap_*` are the router's P/D fields (None when the client sent none): the prefill
    peer's host, its bootstrap (ZMQ) port and the transfer room (a random int < 2**63, new on
    every router retry). `received_at` is `time.monotonic()` when the HTTP request arrived.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs: int = 0  # alternatives per token; 0 unless return_logprob (make_input)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    received_at: float = 0.0
    endpoint: str = "generate"  # generate | completions | chat: for logs only
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """What speculative decoding did for one request: its decode forwards (`verify_ct`, a
    verify of 0 drafts included), the draft tokens proposed for it and those kept."""

    verify_ct: int
    correct_drafts: int
    proposed_drafts: int

    def meta(self, completion_tokens: int) -> dict[str, float | int]:
        """SGLang's `meta_info` fields (`TokenizerManager._calculate_spec_decoding_metrics`):
        none unless a draft was proposed. accept_length = completion tokens / verify_ct (the
        bonus token included); accept_rate = correct / proposed."""
        if self.verify_ct <= 0 or self.proposed_drafts <= 0:
            return {}
        return {"spec_accept_rate": self.correct_drafts / self.proposed_drafts,
                "spec_accept_length": completion_tokens / self.verify_ct,
                "spec_num_correct_drafts": self.correct_drafts,
                "spec_num_proposed_drafts": self.proposed_drafts,
                "spec_verify_ct": self.verify_ct}


@dataclass(slots=True)
class OutputChunk:
    """New tokens for one request since the previous chunk.

    `logprobs[i]` is the logprob of `token_ids[i]` (only when `return_logprob`);
    `top_logprobs[i]` its most likely alternatives (only when `top_logprobs` was asked for).
    `prompt_tokens` / `cached_tokens` (prompt tokens whose KV was reused from the prefix cache)
    are totals, repeated on every chunk; `host_cached_tokens` is the part of `cached_tokens`
    restored from the host tier (the rest was on the device: `cached_tokens_details`).
    `finish_reason` is set on the last chunk only; `matched_stop` is the stop token id that
    ended it (or None for EOS / length).
    `error` (with `error_code`, an abort reason such as `kv_timeout`) ends the request; an error
    chunk may carry no tokens. Its HTTP status is `status`: `error_status` when a backend sets
    one, else the status of `error_code` (`status_for_reason`).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    error: str | None = None
    error_status: int | None = None
    error_code: str = "internal"
    top_logprobs: list[TopLogprobs] | None = None
    spec: SpecCounts | None = None  # speculative decoding so far (the last chunk has it)

    @property
    def status(self) -> int:
        """The HTTP status of an error chunk."""
        return self.error_status or status_for_reason(self.error_code)


# The HTTP status a client gets for a request that ended early, by its reason (the abort and
# failure labels of docs/CONTRACTS.md); 500 for anything else.
_STATUS_BY_REASON = {
    "bad_request": 400, "too_large": 413, "client_abort": 499, "queue_full": 503,
    "queue_timeout": 503, "drain": 503, "swa_reclaim_insufficient": 503,
    "transfer_failed": 502, "peer_dead": 502, "kv_timeout": 504,
}


def status_for_reason(reason: str) -> int:
    """The HTTP status for a request that ended early with `reason`."""
    return _STATUS_BY_REASON.get(reason, 500)


def abort_label(reason: str, status: int) -> str:
    """The abort label (docs/CONTRACTS.md) of a refusal answered `status` with error body
    `reason`: `reason` itself when it is one of the labels with a status, else `too_large` for a
    413, `bad_request` for another 4xx, `internal` otherwise (e.g. a 404 `model_not_found`
    counts as `bad_request`)."""
    if reason in _STATUS_BY_REASON:
        return reason
    if status == 413:
        return "too_large"
    return "bad_request" if 400 <= status < 500 else "internal"


@dataclass(frozen=True, slots=True)
class Load:
    """A worker's load for GET /get_load and GET /v1/loads (one data-parallel rank): requests
    decoding, requests waiting (queued for pages or waiting for their KV), and tokens in use or
    asked for (`num_tokens` = `num_used_tokens` + `num_queued_tokens`). `num_prealloc_reqs` +
    `num_transfer_reqs` break `num_waiting_reqs` down (decode worker; 0 elsewhere);
    `cache_hit_rate` is prefix-cache hit tokens / looked-up tokens since start (0..1).
    `measured_at` is the `time.perf_counter()` of the measurement (reported as `ts_tic`)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_tokens: int = 0
    measured_at: float = 0.0
    num_used_tokens: int = 0
    num_queued_tokens: int = 0
    num_prealloc_reqs: int = 0
    num_transfer_reqs: int = 0
    cache_hit_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class FlushResult:
    """What a cache flush did. `ok` False: refused (requests running or waiting; `message` says
    how many), nothing changed. `num_*_pages`: pages that went back to each pool."""

    ok: bool
    message: str = ""
    num_full_pages: int = 0
    num_swa_pages: int = 0


@dataclass(frozen=True, slots=True)
class Health:
    """`ok` serves; `draining` answers 503 + Retry-After to new work (but while `still_serving`:
    the drain's announce window, when only /health says 503); `unhealthy` answers 503."""

    status: Literal["ok", "draining", "unhealthy"] = "ok"
    message: str = ""
    retry_after_s: int = 5
    still_serving: bool = False

    @property
    def is_ok(self) -> bool:
        return self.status == "ok"

    @property
    def accepts_work(self) -> bool:
        """Whether new generation requests are taken (ok, or draining but still serving)."""
        return self.is_ok or self.still_serving


class Tokenizer(Protocol):
    """What the API layer needs of a tokenizer (device/tokenizer.py provides one)."""

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            tools: list[dict[str, Any]] | None = None,
                            start_date: datetime.date | None = None,
                            reasoning_effort: str | None = None) -> str:
        """The prompt text for these messages (and tools, for templates that render them),
        ending with the assistant turn's opening. `start_date`: the date a template's
        `strftime_now` gives (the same on both P/D legs); `reasoning_effort`: gpt-oss's
        low / medium / high, None for the template's default."""
        ...


class GenerateBackend(Protocol):
    """A token generator behind the HTTP API. See the module docstring for the contract."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def generate(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        """Start `inp`. May raise `ClientError` (4xx) or `ServiceUnavailable` (503) at once or
        on the first `__anext__`; later failures arrive as an `OutputChunk` with `error`."""
        ...

    def abort(self, rid: str, reason: str) -> None:
        """Stop `rid` and free its resources; `reason` is a metrics abort reason."""
        ...

    def finish(self, rid: str) -> None:
        """Stop `rid` as finished normally (the API layer matched a stop string)."""
        ...

    def refuse(self, targets: Sequence[Target], reason: str, message: str) -> None:
        """A generation request was refused before the backend started it: count it once per
        sample (`targets`, at least one), and end each target's room at its prefill peer at
        once with `reason` (an abort label: `abort_label`). A front-end calls it exactly once
        for every generation request it answers with an error before its first chunk, the
        errors `generate` raises included (`generate` never refuses by itself), and never for
        a request whose first chunk was the error (the backend ended that one already).
        Must not block; never raises."""
        ...

    def health(self) -> Health: ...

    def load(self) -> Load:
        """For GET /get_load and /v1/loads: the latest figures, at once (never waits on the
        compute side)."""
        ...

    async def flush_cache(self) -> FlushResult:
        """For /flush_cache: drop every cached prefix no request holds, or refuse (`ok` False)
        while requests run or wait. May raise `ServiceUnavailable` (no engine to ask)."""
        ...

    def server_info(self) -> dict[str, Any]:
        """For GET /server_info. Must hold `model_path`: a local directory with tokenizer.json
        (the router loads its tokenizer from there); the router also reads `tp_size`,
        `dp_size` and `disaggregation_mode` ("decode" / "prefill")."""
        ...

    def model_info(self) -> dict[str, Any]:
        """For GET /model_info: `model_path`, `tokenizer_path`, `is_generation`, ..."""
        ...
