"""SGLang's native `POST /generate` (non-streaming and SSE).

Streaming events carry the cumulative `text`, `output_ids` and `meta_info` (SGLang's default,
non-incremental stream output), then `data: [DONE]`. An error after the stream started is an
SSE `data: {"error": {...}}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from decode_worker.core.sampling import check_top_logprobs
from decode_worker.errors import ClientError
from decode_worker.io.api.common import (
    SSE_DONE,
    RunStream,
    check_prompt,
    collect,
    error_obj,
    sse,
    vocab_size_of,
)
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.message import Request, Response, StreamResponse
from decode_worker.io.api.run import GenerationRun
from decode_worker.io.api.schemas import (
    GenerateReq,
    SamplingIn,
    check_bootstrap,
    decode_body,
    sampling_from_generate,
)


async def handle_generate(app: ApiContext, req: Request) -> Response | StreamResponse:
    body = decode_body(req.body, GenerateReq)
    check_bootstrap(body)
    if (body.text is None) == (body.input_ids is None):
        raise ClientError("give exactly one of `text` or `input_ids`")
    text = body.text
    raw_ids = app.backend.tokenizer.encode(text) if text is not None else body.input_ids or []
    ids = check_prompt(raw_ids, app.config.max_prompt_tokens,
                       vocab_size_of(app.backend.tokenizer))
    sp = body.sampling_params or SamplingIn()
    sampling = sampling_from_generate(
        sp, app.max_new_tokens(len(ids), sp.max_new_tokens, default=None))  # up to the context
    inp = app.make_input(body.rid, ids, sampling, body, stream=body.stream,
                         return_logprob=body.return_logprob, endpoint="generate",
                         received_at=req.received_at,
                         top_logprobs=check_top_logprobs(body.top_logprobs_num,
                                                         "top_logprobs_num"))
    run = await app.start_run(inp)
    if body.stream:
        return StreamResponse(200, RunStream(_stream(run), run))
    await collect(run)
    fin = run.finish
    if fin is not None and fin.reason == "error":
        return Response.json(error_obj(fin.message or "", fin.status, fin.code), fin.status)
    return Response.json(_body(run, run.text.text, run.output_ids))


def _meta(run: GenerationRun) -> dict[str, Any]:
    fin = run.finish
    meta: dict[str, Any] = {
        "id": run.inp.extra.get("client_rid", run.inp.rid),
        "finish_reason": fin.sglang(len(run.output_ids)) if fin is not None else None,
        "prompt_tokens": run.prompt_tokens,
        "completion_tokens": len(run.output_ids),
        "cached_tokens": run.cached_tokens,
    }
    if run.inp.return_logprob:
        meta["output_token_logprobs"] = run.output_token_logprobs()
    if run.inp.top_logprobs:
        meta["output_top_logprobs"] = run.output_top_logprobs()
    return meta


def _body(run: GenerationRun, text: str, output_ids: list[int]) -> dict[str, Any]:
    return {"text": text, "output_ids": list(output_ids), "meta_info": _meta(run)}


async def _stream(run: GenerationRun) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(run.steps()) as steps:
        async for step in steps:
            fin = step.finish
            if fin is not None and fin.reason == "error":
                yield sse(error_obj(fin.message or "internal error", fin.status, fin.code))
                break
            if step.text or step.token_ids or fin is not None:
                yield sse(_body(run, run.text.text, run.output_ids))
    yield SSE_DONE
