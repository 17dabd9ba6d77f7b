"""The `POST /v1/responses` body (msgspec) and the fields this stateless server refuses.

Unknown fields are accepted and ignored, as on every route (the gateway adds its own). smg
re-serializes the body it forwards and always sends `top_k` (-1), `min_p` (0),
`repetition_penalty` (1.0) and `priority` (0), and `temperature` 1.0 when the client sent
none: the neutral values pass; a penalty that would change the output is a 400
(`schemas.refuse_unapplied`), as on chat.

Stateless under P/D (SGLang's decision too, sgl-project/sglang#39122): the gateway sends the
same body to the prefill and to the decode server, and both must render the same prompt from it,
so nothing may come from server-side history. `previous_response_id`, `conversation`, a stored
`prompt` template and `background: true` are a 400 naming why; `store: true` is served without
storing and the answer says `"store": false`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from decode_worker.errors import ClientError
from decode_worker.io.api.schemas import Bootstrap

STATELESS = ("this server keeps no responses: under prefill/decode disaggregation both servers "
             "must render the prompt from the request alone (send the whole conversation in "
             "`input`, as Codex does, with store=false)")


class ReasoningIn(msgspec.Struct):
    """`reasoning`: `effort` (gpt-oss: low / medium / high) and `summary` (accepted; no
    summaries are generated: reasoning items carry the reasoning text itself)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextIn(msgspec.Struct):
    """`text`: `format` ({"type": "text" | "json_object" | "json_schema", ...}); `verbosity`
    is accepted (gpt-oss has no such control)."""

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesReq(Bootstrap):
    """OpenAI's Responses request plus the router's P/D fields (`Bootstrap`)."""

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: ReasoningIn | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # SGLang's extensions (smg sends top_k, min_p always)
    min_p: float | None = None
    seed: int | None = None
    top_logprobs: int | None = None
    text: TextIn | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    store: bool | None = None
    stream: bool | None = None  # smg once sent `"stream": null` (smg-project/smg#2250)
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    request_id: str | None = None  # SGLang's; the response id is built from it
    frequency_penalty: float | None = None  # not applied: 400 unless neutral (Penalties)
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


def refuse_stateful(body: ResponsesReq) -> None:
    """Raise ClientError (400) for a field that needs a response store (see the module doc)."""
    if body.previous_response_id is not None:
        raise ClientError(f"previous_response_id is not supported: {STATELESS}")
    if body.conversation is not None:
        raise ClientError(f"conversation is not supported: {STATELESS}")
    if body.prompt is not None:
        raise ClientError(f"prompt (a stored prompt template) is not supported: {STATELESS}")
    if body.background:
        raise ClientError(f"background=true is not supported: there is nothing to poll, "
                          f"{STATELESS}; send stream=true for a long answer")
    if body.top_logprobs:
        raise ClientError("top_logprobs is not supported on /v1/responses (it would be "
                          "ignored); use /v1/chat/completions with logprobs")
    if body.truncation not in (None, "disabled", "auto"):
        raise ClientError(f"truncation={body.truncation!r}: must be 'disabled' or 'auto'")


# gpt-oss knows three efforts; the others OpenAI clients send map as SGLang maps them
# (sgl-project/sglang@008b79d): Codex sends "max" (sgl-project/sglang#33633).
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high", "max": "high"}


def reasoning_effort(reasoning: ReasoningIn | None) -> str | None:
    """The harmony effort for the chat template (None: the template's default, medium)."""
    if reasoning is None or reasoning.effort is None:
        return None
    effort = EFFORTS.get(reasoning.effort)
    if effort is None:
        raise ClientError(f"reasoning.effort={reasoning.effort[:40]!r}: must be one of "
                          f"{', '.join(EFFORTS)}")
    return effort
