"""OpenAI-compatible `POST /v1/completions` (and what chat completions share: `chat.py`).

Non-streaming answers carry `usage` with `prompt_tokens_details.cached_tokens`; with SGLang's
`return_cached_tokens_details: true` also a response-level `sglext.cached_tokens_details`
(`{"device", "host"}`, as SGLang's). Streams send one chunk per text delta, a final chunk with
`finish_reason`, (when asked for) one `sglext` chunk with no choices, a usage chunk when
`stream_options.include_usage`, then `data: [DONE]`; an error mid-stream is an SSE error event
then `[DONE]`. `n > 1` and a batch of prompts (completions) give one choice per sample
(`samples.py`, `openai_shape.py`); `echo` is not supported. A `model` other than the served
name is a 404 (unless `api.strict_model_name` is false); `max_tokens` defaults to 16 on
completions and to the room left in the context on chat (`limits.py`).
"""

from __future__ import annotations

from typing import Any

from decode_worker.core.sampling import check_top_logprobs
from decode_worker.errors import ClientError
from decode_worker.io.api.common import RunStream, check_prompt, error_obj, vocab_size_of
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.harmony.chat import ChatParsing
from decode_worker.io.api.harmony.tools import ToolPlan
from decode_worker.io.api.limits import COMPLETIONS_DEFAULT_MAX_TOKENS
from decode_worker.io.api.message import Request, Response, StreamResponse
from decode_worker.io.api.openai_shape import OpenAIShape, stream_chunks
from decode_worker.io.api.samples import Prompt, build_inputs, collect_all, start_all
from decode_worker.io.api.schemas import (
    CompletionReq,
    OpenAIBase,
    decode_body,
    requested_max_tokens,
    sampling_from_openai,
)


async def handle_completions(app: ApiContext, req: Request) -> Response | StreamResponse:
    body = decode_body(req.body, CompletionReq)
    app.check_model(body.model)
    if body.echo:
        raise ClientError("echo=true is not supported")
    prompts = _prompt_ids(app, body.prompt)
    top = check_top_logprobs(body.logprobs, "logprobs")  # completions: logprobs=N alternatives
    return await serve(app, body, prompts, top > 0, top, chat=False,
                        received_at=req.received_at)


async def serve(
    app: ApiContext, body: OpenAIBase, prompt_ids: list[list[int]], logprobs: bool,
    top_logprobs: int, chat: bool, received_at: float, *, tools: ToolPlan | None = None,
    parsing: ChatParsing | None = None,
) -> Response | StreamResponse:
    """Run the samples of `prompt_ids` and answer. Chat: `tools` when a tool-call parser took
    the request's tools (their grammar forces a call), `parsing` how its output is split."""
    vocab = vocab_size_of(app.backend.tokenizer)
    default = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS  # chat: up to the context
    prompts = []
    for raw in prompt_ids:
        ids = check_prompt(raw, app.config.max_prompt_tokens, vocab)
        max_new = app.max_new_tokens(len(ids), requested_max_tokens(body), default=default)
        prompts.append(Prompt(ids, sampling_from_openai(
            body, max_new, tools_parsed=tools is not None,
            tool_grammar=tools.grammar if tools is not None else None)))
    inps = build_inputs(app, prompts, body.n, body, body.rid, stream=body.stream,
                        return_logprob=logprobs, top_logprobs=top_logprobs,
                        endpoint="chat" if chat else "completions", received_at=received_at)
    runs = await start_all(app, inps)
    shape = OpenAIShape(app.model_name(), runs, body.n, chat, parsing,
                        cache_details=body.return_cached_tokens_details)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamResponse(200, RunStream(stream_chunks(shape, usage), runs))
    fin = await collect_all(runs)
    if fin is not None:
        return Response.json(error_obj(fin.message or "", fin.status, fin.code), fin.status)
    return Response.json(shape.full())


def _prompt_ids(app: ApiContext, prompt: str | list[Any] | None) -> list[list[int]]:
    """`prompt` as a string, a list of token ids, or a batch: a list of strings or of token
    id lists (one choice per prompt and sample). Raises ClientError."""
    if prompt is None:
        raise ClientError("prompt is required")
    if isinstance(prompt, str):
        return [app.backend.tokenizer.encode(prompt)]
    if prompt and all(type(t) is int for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [app.backend.tokenizer.encode(p) for p in prompt]
    if prompt and all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise ClientError("prompt must be a string, a list of token ids, or a non-empty list of "
                      "either (a batch)")
