"""OpenAI-compatible `POST /v1/chat/completions`.

The messages (with an assistant's earlier `tool_calls`, a tool's result, an earlier turn's
`reasoning_content`) and the request's `tools` are rendered by the tokenizer's chat template.
For a harmony model (gpt-oss, the built-in tiny model), a Qwen3 or a Llama 3.x model the
output is parsed into `reasoning_content`, `content` and `tool_calls` (`harmony/chat.py` and
`textchat/` say when and how); `tools` and
`tool_choice` are accepted when a tool-call parser is on (`harmony/tools.py`: "required" and a
named function are enforced with a grammar), else they are a 400 (`structured.py`). The rest
(streams, usage, n, errors) is as for completions (`openai.py`).
"""

from __future__ import annotations

from typing import Any

from decode_worker.core.sampling import check_top_logprobs
from decode_worker.errors import ClientError
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.harmony.chat import chat_parsing, parser_on
from decode_worker.io.api.harmony.tools import ToolPlan, plan_tools, tool_names
from decode_worker.io.api.message import Request, Response, StreamResponse
from decode_worker.io.api.openai import serve
from decode_worker.io.api.schemas import ChatReq, Message, decode_body
from decode_worker.io.api.textchat.select import output_format


async def handle_chat(app: ApiContext, req: Request) -> Response | StreamResponse:
    body = decode_body(req.body, ChatReq)
    app.check_model(body.model)
    if not body.messages:
        raise ClientError("messages must be a non-empty list")
    tok = app.backend.tokenizer
    tokens = output_format(tok)
    tools: ToolPlan | None = None  # None: tools are not parsed (a 400 if the request has some)
    if tokens is not None and parser_on(app.config.tool_call_parser, tokens):
        tools = plan_tools(body.tools, body.tool_choice, tokens)
    prompt = tok.apply_chat_template(chat_messages(body.messages),
                                     tools=tools.tools if tools is not None else None,
                                     start_date=app.config.system_start_date)
    top = check_top_logprobs(body.top_logprobs, "top_logprobs")
    if top and not body.logprobs:
        raise ClientError("top_logprobs needs logprobs=true")
    parsing = chat_parsing(tokens, app.config.reasoning_parser, body.separate_reasoning,
                           app.config.tool_call_parser, tools is not None and tools.parse_calls,
                           tool_names(tools))
    return await serve(app, body, [tok.encode(prompt)], body.logprobs, top, chat=True,
                       received_at=req.received_at, tools=tools, parsing=parsing)


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them. A tool message without `name` gets the
    name of the earlier call with its `tool_call_id` (templates name the function)."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": _content(m)}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
            for call in m.tool_calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(call.get("id"), str):
                    names[call["id"]] = str(fn.get("name", ""))
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        name = m.name or (names.get(m.tool_call_id) if m.tool_call_id else None)
        if name:
            msg["name"] = name
        out.append(msg)
    return out


def _content(m: Message) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.type != "text":
            raise ClientError(f"message content type {part.type!r} is not supported")
        parts.append(part.text or "")
    return "".join(parts)
