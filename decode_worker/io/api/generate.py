"""SGLang's native `POST /generate` (non-streaming and SSE).

Streaming events carry the cumulative `text`, `output_ids` and `meta_info` (SGLang's default,
non-incremental stream output), then `data: [DONE]`. A batch (`text` or `input_ids` as a list of
prompts) or `sampling_params.n > 1` is answered with a list in sample order (`samples.py`), and
each streamed event names its sample's `index`. An error after the stream started is an
SSE `data: {"error": {...}}` event followed by `data: [DONE]`.
`meta_info.cached_tokens_details` is SGLang's split of `cached_tokens`: `{"device", "host"}`
(host: restored from the host tier), null when nothing was cached.
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
    cached_tokens_details,
    check_prompt,
    error_obj,
    sse,
    vocab_size_of,
)
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.message import Request, Response, StreamResponse
from decode_worker.io.api.run import GenerationRun
from decode_worker.io.api.samples import (
    Prompt,
    build_inputs,
    collect_all,
    merged_steps,
    start_all,
)
from decode_worker.io.api.schemas import (
    GenerateReq,
    SamplingIn,
    decode_body,
    sampling_from_generate,
)


async def handle_generate(app: ApiContext, req: Request) -> Response | StreamResponse:
    body = decode_body(req.body, GenerateReq)
    sp = body.sampling_params or SamplingIn()
    prompts = [Prompt(ids, sampling_from_generate(  # up to the context when omitted
                   sp, app.max_new_tokens(len(ids), sp.max_new_tokens, default=None)))
               for ids in _prompt_ids(app, body)]
    inps = build_inputs(app, prompts, sp.n, body, body.rid, stream=body.stream,
                        return_logprob=body.return_logprob,
                        top_logprobs=check_top_logprobs(body.top_logprobs_num,
                                                        "top_logprobs_num"),
                        endpoint="generate", received_at=req.received_at)
    # a batch or n > 1 is answered with a list (streams: each event names its `index`)
    many = isinstance(body.text, list) or _is_id_batch(body.input_ids) or len(inps) > 1
    runs = await start_all(app, inps)
    if body.stream:
        return StreamResponse(200, RunStream(_stream(runs, many), runs))
    fin = await collect_all(runs)
    if fin is not None:
        return Response.json(error_obj(fin.message or "", fin.status, fin.code), fin.status)
    bodies = [_body(run) for run in runs]
    return Response.json(bodies if many else bodies[0])


def _prompt_ids(app: ApiContext, body: GenerateReq) -> list[list[int]]:
    """The checked prompts: `text` (a string or a list of them) or `input_ids` (a list of ids
    or a list of such lists). Raises ClientError."""
    if (body.text is None) == (body.input_ids is None):
        raise ClientError("give exactly one of `text` or `input_ids`")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        raw = [app.backend.tokenizer.encode(t) for t in texts]
    else:
        raw = _id_lists(body.input_ids or [])
    if not raw:
        raise ClientError("the batch is empty")
    vocab = vocab_size_of(app.backend.tokenizer)
    return [check_prompt(r, app.config.max_prompt_tokens, vocab) for r in raw]


def _is_id_batch(ids: list[Any] | None) -> bool:
    return bool(ids) and isinstance(ids[0], list)  # type: ignore[index]


def _id_lists(ids: list[Any]) -> list[list[int]]:
    """`input_ids` as a list of prompts; ClientError unless it is a list of ints or a list of
    lists of ints."""
    batch = ids if _is_id_batch(ids) else [ids]
    for prompt in batch:
        if not isinstance(prompt, list) or any(type(t) is not int for t in prompt):
            raise ClientError("input_ids must be a list of token ids or a list of such lists")
    return batch


def _meta(run: GenerationRun) -> dict[str, Any]:
    fin = run.finish
    meta: dict[str, Any] = {
        "id": run.inp.extra.get("client_rid", run.inp.rid),
        "finish_reason": fin.sglang(len(run.output_ids)) if fin is not None else None,
        "prompt_tokens": run.prompt_tokens,
        "completion_tokens": len(run.output_ids),
        "cached_tokens": run.cached_tokens,
        "cached_tokens_details": cached_tokens_details(run.cached_tokens,
                                                       run.host_cached_tokens),
    }
    if run.spec is not None:
        meta.update(run.spec.meta(len(run.output_ids)))
    if run.inp.return_logprob:
        meta["output_token_logprobs"] = run.output_token_logprobs()
    if run.inp.top_logprobs:
        meta["output_top_logprobs"] = run.output_top_logprobs()
    return meta


def _body(run: GenerationRun, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"text": run.text.text, "output_ids": list(run.output_ids),
                            "meta_info": _meta(run)}
    if index is not None:
        body["index"] = index
    return body


async def _stream(runs: list[GenerationRun], many: bool) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(merged_steps(runs)) as steps:
        async for k, step in steps:
            fin = step.finish
            if fin is not None and fin.reason == "error":
                yield sse(error_obj(fin.message or "internal error", fin.status, fin.code))
                break
            if step.text or step.token_ids or fin is not None:
                yield sse(_body(runs[k], k if many else None))
    yield SSE_DONE
