"""`POST /v1/responses` and `GET|DELETE /v1/responses/{id}` (and `.../cancel`).

One request, one run: the body is checked (`schema.py`), rendered by the chat template as
`/v1/chat/completions` renders a chat (`inputs.py`; the same tools plan, `harmony/tools.py`:
`tool_choice` "required" or a named function is enforced with the same grammar), run with the
router's P/D fields like every generation route (`samples.build_inputs`), and its output parsed
by the same harmony parser as chat (`shape.py`, `output.py`). Both servers (decode worker and
prefill peer) serve it with this code, so the gateway's two legs render the same prompt (the
date a template asks `strftime_now` for is the pinned `api.system_start_date`).

Retrieval, deletion and cancellation answer 404 naming why: nothing is stored.
"""

from __future__ import annotations

from decode_worker.core.sampling import SamplingParams, pick_grammar
from decode_worker.errors import ClientError
from decode_worker.io.api.common import RunStream, check_prompt, error_obj, vocab_size_of
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.harmony.chat import chat_parsing, parser_on
from decode_worker.io.api.harmony.tools import ToolPlan, plan_tools, tool_names
from decode_worker.io.api.message import Request, Response, StreamResponse
from decode_worker.io.api.responses import inputs
from decode_worker.io.api.responses.schema import (
    STATELESS,
    ResponsesReq,
    reasoning_effort,
    refuse_stateful,
)
from decode_worker.io.api.responses.shape import ResponseShape, stream_events
from decode_worker.io.api.samples import Prompt, build_inputs, collect_all, start_all
from decode_worker.io.api.schemas import build_sampling, decode_body, refuse_unapplied
from decode_worker.io.api.structured import grammar_from_response_format, refuse_tools
from decode_worker.io.api.textchat.select import output_format

PREFIX = "/v1/responses/"


class NotStored(ClientError):
    status = 404
    reason = "not_found"


async def handle_responses(app: ApiContext, req: Request) -> Response | StreamResponse:
    body = decode_body(req.body, ResponsesReq)
    app.check_model(body.model)
    refuse_stateful(body)
    tok = app.backend.tokenizer
    tokens = output_format(tok)
    messages = inputs.chat_messages(body.instructions, body.input)
    tools, choice = inputs.chat_tools(body.tools), inputs.chat_tool_choice(body.tool_choice)
    plan: ToolPlan | None = None  # None: tools are not parsed (a 400 if the request has some)
    if tokens is not None and parser_on(app.config.tool_call_parser, tokens):
        plan = plan_tools(tools, choice, tokens)
    else:
        refuse_tools(tools, choice, None)
    effort = reasoning_effort(body.reasoning)
    prompt = tok.apply_chat_template(messages, tools=plan.tools if plan is not None else None,
                                     start_date=app.config.system_start_date,
                                     reasoning_effort=effort)
    ids = check_prompt(tok.encode(prompt), app.config.max_prompt_tokens, vocab_size_of(tok))
    inps = build_inputs(app, [Prompt(ids, _sampling(app, body, len(ids), plan))], 1, body,
                        body.request_id, stream=bool(body.stream), return_logprob=False,
                        top_logprobs=0, endpoint="responses", received_at=req.received_at)
    runs = await start_all(app, inps)
    parsing = chat_parsing(tokens, app.config.reasoning_parser, True,
                           app.config.tool_call_parser, plan is not None and plan.parse_calls,
                           tool_names(plan))
    shape = ResponseShape(app.model_name(), body, runs[0], parsing, effort)
    if body.stream:
        return StreamResponse(200, RunStream(stream_events(shape), runs))
    fin = await collect_all(runs)
    if fin is not None:
        return Response.json(error_obj(fin.message or "", fin.status, fin.code), fin.status)
    return Response.json(shape.run_whole())


def _sampling(app: ApiContext, body: ResponsesReq, prompt_tokens: int,
              plan: ToolPlan | None) -> SamplingParams:
    """The run's sampling: limits, the output constraint (`text.format` or a forced call)."""
    refuse_unapplied(body, None)
    fmt = inputs.response_format(body.text.format if body.text is not None else None)
    grammar = pick_grammar({"text.format": grammar_from_response_format(fmt),
                            "tool_choice": plan.grammar if plan is not None else None})
    return build_sampling(
        max_new_tokens=app.max_new_tokens(prompt_tokens, body.max_output_tokens, default=None),
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        seed=body.seed, grammar=grammar)


async def handle_stored(app: ApiContext, req: Request) -> Response:
    """`GET|DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: always 404."""
    rid = req.path[len(PREFIX):].removesuffix("/cancel")[:100]
    raise NotStored(f"response {rid!r} not found: {STATELESS}")
