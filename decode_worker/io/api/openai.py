"""OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions`.

Non-streaming answers carry `usage` with `prompt_tokens_details.cached_tokens`. Streams send
one chunk per text delta, a final chunk with `finish_reason`, a usage chunk when
`stream_options.include_usage`, then `data: [DONE]`; an error mid-stream is an SSE error event
then `[DONE]`. Only `n=1`; `echo` is not supported. A `model` other than the served name is a
404 (unless `api.strict_model_name` is false); `max_tokens` defaults to 16 on completions and to
the room left in the context on chat (`limits.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from decode_worker.core.sampling import TopLogprobs, check_top_logprobs
from decode_worker.errors import ClientError
from decode_worker.io.api.common import (
    SSE_DONE,
    RunStream,
    check_prompt,
    collect,
    error_obj,
    now_s,
    sse,
    vocab_size_of,
)
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.limits import COMPLETIONS_DEFAULT_MAX_TOKENS
from decode_worker.io.api.message import Request, Response, StreamResponse
from decode_worker.io.api.run import Finish, GenerationRun
from decode_worker.io.api.schemas import (
    ChatReq,
    CompletionReq,
    Message,
    OpenAIBase,
    check_bootstrap,
    decode_body,
    requested_max_tokens,
    sampling_from_openai,
)


async def handle_completions(app: ApiContext, req: Request) -> Response | StreamResponse:
    body = decode_body(req.body, CompletionReq)
    app.check_model(body.model)
    if body.echo:
        raise ClientError("echo=true is not supported")
    ids = _prompt_ids(app, body.prompt)
    top = check_top_logprobs(body.logprobs, "logprobs")  # completions: logprobs=N alternatives
    return await _serve(app, body, ids, top > 0, top, chat=False, received_at=req.received_at)


async def handle_chat(app: ApiContext, req: Request) -> Response | StreamResponse:
    body = decode_body(req.body, ChatReq)
    app.check_model(body.model)
    if not body.messages:
        raise ClientError("messages must be a non-empty list")
    prompt = app.backend.tokenizer.apply_chat_template([_message(m) for m in body.messages])
    ids = app.backend.tokenizer.encode(prompt)
    top = check_top_logprobs(body.top_logprobs, "top_logprobs")
    if top and not body.logprobs:
        raise ClientError("top_logprobs needs logprobs=true")
    return await _serve(app, body, ids, body.logprobs, top, chat=True,
                        received_at=req.received_at)


async def _serve(
    app: ApiContext, body: OpenAIBase, ids: list[int], logprobs: bool, top_logprobs: int,
    chat: bool, received_at: float,
) -> Response | StreamResponse:
    check_bootstrap(body)
    ids = check_prompt(ids, app.config.max_prompt_tokens, vocab_size_of(app.backend.tokenizer))
    default = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS  # chat: up to the context
    max_new = app.max_new_tokens(len(ids), requested_max_tokens(body), default=default)
    sampling = sampling_from_openai(body, max_new)
    inp = app.make_input(body.rid, ids, sampling, body, stream=body.stream,
                         return_logprob=logprobs, endpoint="chat" if chat else "completions",
                         received_at=received_at, top_logprobs=top_logprobs)
    run = await app.start_run(inp)
    shape = _Shape(app.model_name(), run, chat)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamResponse(200, RunStream(_stream(shape, usage), run))
    await collect(run)
    fin = run.finish
    if fin is not None and fin.reason == "error":
        return Response.json(error_obj(fin.message or "", fin.status, fin.code), fin.status)
    return Response.json(shape.full())


def _prompt_ids(app: ApiContext, prompt: str | list[Any] | None) -> list[int]:
    """`prompt` as a string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return app.backend.tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    if prompt is None:
        raise ClientError("prompt is required")
    raise ClientError("prompt must be a string or a list of token ids (no batches)")


def _message(m: Message) -> dict[str, Any]:
    if m.content is None or isinstance(m.content, str):
        return {"role": m.role, "content": m.content or ""}
    parts = []
    for part in m.content:
        if part.type != "text":
            raise ClientError(f"message content type {part.type!r} is not supported")
        parts.append(part.text or "")
    return {"role": m.role, "content": "".join(parts)}


class _Shape:
    """Builds the OpenAI response objects of one run."""

    def __init__(self, model: str, run: GenerationRun, chat: bool) -> None:
        self.model, self.run, self.chat = model, run, chat
        rid = run.inp.extra.get("client_rid", run.inp.rid)
        self.id = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"
        self.created = now_s()
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self) -> dict[str, Any]:
        run = self.run
        done = len(run.output_ids)
        return {"prompt_tokens": run.prompt_tokens, "completion_tokens": done,
                "total_tokens": run.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": run.cached_tokens}}

    def logprobs(self, ids: list[int], lps: list[float],
                 tops: list[TopLogprobs]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for `ids` (and their alternatives when asked for)."""
        if not self.run.inp.return_logprob:
            return None
        tok = self.run.backend.tokenizer
        tokens = [tok.decode([t]) for t in ids]
        alts = [[(tok.decode([t]), lp) for t, lp in top] for top in tops] or [[]] * len(ids)
        if self.chat:
            return {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                  for a, alp in alt]}
                for t, lp, alt in zip(tokens, lps, alts, strict=False)]}
        top_dicts = [dict(alt) for alt in alts] if self.run.inp.top_logprobs else None
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_dicts,
                "text_offset": []}

    def choice(self, text: str, fin: Finish | None, lp: dict[str, Any] | None,
               delta: bool) -> dict[str, Any]:
        reason = fin.reason if fin is not None else None
        out: dict[str, Any] = {"index": 0, "logprobs": lp, "finish_reason": reason,
                               "matched_stop": fin.matched if fin is not None else None}
        if not self.chat:
            out["text"] = text
        elif delta:
            out["delta"] = {"content": text} if text or fin is None else {}
        else:
            out["message"] = {"role": "assistant", "content": text}
        return out

    def full(self) -> dict[str, Any]:
        run = self.run
        lp = self.logprobs(run.output_ids, run.logprobs, run.top_logprobs)
        body = self._envelope([self.choice(run.text.text, run.finish, lp, delta=False)], False)
        body["usage"] = self.usage()
        return body

    def chunk(self, choice: dict[str, Any] | None, usage: bool = False) -> bytes:
        body = self._envelope([choice] if choice is not None else [], True)
        if usage:
            body["usage"] = self.usage()
        return sse(body)


async def _stream(shape: _Shape, include_usage: bool) -> AsyncGenerator[bytes, None]:
    if shape.chat:
        first = shape.choice("", None, None, delta=True)
        first["delta"] = {"role": "assistant", "content": ""}
        yield shape.chunk(first)
    ids: list[int] = []  # tokens (and logprobs) not yet sent: their text is still held back
    lps: list[float] = []
    tops: list[TopLogprobs] = []
    async with contextlib.aclosing(shape.run.steps()) as steps:
        async for step in steps:
            fin = step.finish
            if fin is not None and fin.reason == "error":
                yield sse(error_obj(fin.message or "internal error", fin.status, fin.code))
                yield SSE_DONE
                return
            ids += step.token_ids
            lps += step.logprobs
            tops += step.top_logprobs
            if step.text or fin is not None:
                lp = shape.logprobs(ids, lps, tops)
                ids, lps, tops = [], [], []
                yield shape.chunk(shape.choice(step.text, fin, lp, delta=True))
    if include_usage:
        yield shape.chunk(None, usage=True)
    yield SSE_DONE
