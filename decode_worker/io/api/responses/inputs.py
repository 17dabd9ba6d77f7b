"""A Responses request as the chat template takes it: messages, tools, tool_choice, format.

The prompt is rendered by the same chat template as `/v1/chat/completions` (one renderer):
- `instructions` -> a leading system message (gpt-oss templates put it in the developer
  message, as harmony wants);
- `input` as a string -> one user message; as items:
  - `message` (role user / system / developer / assistant; content a string or text parts:
    `input_text`, `output_text`, `text`; a `refusal` part is text) -> that message;
  - `reasoning` (its `content` reasoning_text parts, else its `summary` texts) -> the
    `reasoning_content` of the assistant turn it starts (harmony: the analysis message);
  - `function_call` (call_id, name, arguments) -> a `tool_calls` entry of the assistant turn;
  - `function_call_output` (call_id, output: a string or text parts, as Codex sends it) -> a
    tool message, named after the earlier call with that call_id (a 400 when there is none:
    the template must name the function);
  - anything else (images, files, built-in tool calls, item references) -> a 400 naming it.
  Consecutive reasoning / assistant message / function_call items form one assistant turn; a
  reasoning item after text or calls starts the next one.
- `tools`: function tools (`{"type": "function", "name", "description", "parameters"}`) ->
  the chat shape; a built-in tool type is a 400 naming the type. `tool_choice` likewise.
- `text.format` -> chat's `response_format`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from decode_worker.errors import ClientError
from decode_worker.io.api.structured import JsonSchemaFormat, ResponseFormat, _short

TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
ROLES = frozenset({"user", "system", "developer", "assistant"})


def chat_messages(instructions: str | None, items: str | list[Any] | None) -> list[dict[str, Any]]:
    """The chat messages of a request (see the module doc). Raises ClientError."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if items is None or items == "" or items == []:
        raise ClientError("input is required: a string or a non-empty list of items")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    turn: dict[str, Any] | None = None  # the assistant turn being built
    names: dict[str, str] = {}  # call_id -> function name
    for k, item in enumerate(items):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise ClientError(f"{where}: an item must be an object")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") != "assistant":
            _flush(out, turn)
            turn = None
            out.append({"role": _role(item, where), "content": _text(item.get("content"), where)})
        elif kind == "function_call_output":
            _flush(out, turn)
            turn = None
            out.append(_tool_result(item, names, where))
        elif kind in ("message", "reasoning", "function_call"):
            turn = _into_turn(out, turn, item, kind, names, where)
        else:
            raise ClientError(f"{where}: item type {str(kind)[:40]!r} is not supported (message, "
                              "reasoning, function_call and function_call_output are)")
    _flush(out, turn)
    return out


def _flush(out: list[dict[str, Any]], turn: dict[str, Any] | None) -> None:
    if turn is not None:
        out.append(turn)


def _into_turn(out: list[dict[str, Any]], turn: dict[str, Any] | None, item: dict[str, Any],
               kind: str, names: dict[str, str], where: str) -> dict[str, Any]:
    """Add an assistant-side item to the current turn (or a new one); returns the turn."""
    if turn is None or (kind != "function_call" and (turn["content"] or turn.get("tool_calls"))):
        _flush(out, turn)
        turn = {"role": "assistant", "content": ""}
    if kind == "reasoning":
        turn["reasoning_content"] = _reasoning_text(item, where)
    elif kind == "message":
        turn["content"] = _text(item.get("content"), where)
    else:
        call_id, name = _str(item, "call_id", where), _str(item, "name", where)
        args = item.get("arguments", "")
        if not isinstance(args, str):
            raise ClientError(f"{where}.arguments must be a JSON string")
        names[call_id] = name
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return turn


def _tool_result(item: dict[str, Any], names: dict[str, str], where: str) -> dict[str, Any]:
    call_id = _str(item, "call_id", where)
    if call_id not in names:
        raise ClientError(f"{where}: no function_call with call_id {call_id[:64]!r} before this "
                          "function_call_output (send the whole conversation in `input`)")
    return {"role": "tool", "tool_call_id": call_id, "name": names[call_id],
            "content": _text(item.get("output"), f"{where}.output")}


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise ClientError(f"{where}.role={_short(role)}: must be one of {', '.join(sorted(ROLES))}")
    return str(role)


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ClientError(f"{where}.{key} is required (a string)")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of text parts. Raises ClientError for other parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ClientError(f"{where}: content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ClientError(f"{where}.content[{j}]: part type {_short(kind)} is not supported "
                              "(text only: input_text, output_text)")
        texts.append(str(part.get("text") if kind != "refusal" else part.get("refusal")) or "")
    return "".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or []
    if not parts:  # a client that kept only the summary
        parts = item.get("summary") or []
    if not isinstance(parts, list):
        raise ClientError(f"{where}: reasoning content must be a list of parts")
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    return "\n".join(t for t in texts if isinstance(t, str))


# -- tools, tool_choice, text.format --------------------------------------------------------

def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools in the chat shape. Raises ClientError naming a built-in type."""
    if tools is None:
        return None
    out = []
    for k, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ClientError(f"tools[{k}]: tool type {_short(kind)} is not supported: this "
                              "server runs function tools only (no built-in or MCP tools)")
        fn = {key: tool[key] for key in ("name", "description", "parameters", "strict")
              if tool.get(key) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses `tool_choice` in the chat shape ({"type": "function", "name"} -> chat's
    nested form). Raises ClientError for a built-in or allowed_tools choice."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ClientError(f"tool_choice={_short(choice)}: must be \"auto\", \"none\", \"required\" "
                      "or {\"type\": \"function\", \"name\": ...}")


def response_format(fmt: dict[str, Any] | None) -> ResponseFormat | None:
    """`text.format` as chat's `response_format`. Raises ClientError."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        try:
            schema = msgspec.convert(fmt, JsonSchemaFormat)
        except msgspec.ValidationError as exc:
            raise ClientError(f"text.format: {exc}") from None
        if schema.schema is None:
            raise ClientError("text.format.schema is required for type 'json_schema'")
        return ResponseFormat("json_schema", schema)
    if kind in ("text", "json_object"):
        return ResponseFormat(str(kind))
    raise ClientError(f"text.format.type={_short(kind)}: must be 'text', 'json_object' or "
                      "'json_schema'")
