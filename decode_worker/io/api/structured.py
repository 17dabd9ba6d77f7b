"""Structured output and tool fields of a request: what the output must match, or a 400.

- OpenAI `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any
  JSON object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
- SGLang `sampling_params.json_schema` (the schema as a string, or an object), `regex`,
  `ebnf` (xgrammar's EBNF), at most one of them.

They become a `GrammarSpec` on the request's `SamplingParams`; only cheap checks happen here (io
imports no torch): the backend compiles it with xgrammar (`device/grammar.py`) before the request
runs, and a grammar it cannot compile is a 400 with xgrammar's message. Tool calls are parsed
for harmony models in chat (`harmony/`); elsewhere (completions, a model without the harmony
tokens, `api.tool_call_parser=none`) `tools` (unless `tool_choice` is "none"), a forced
`tool_choice` and the older `functions` are refused with a 400 that says so, never silently
ignored.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from decode_worker.core.sampling import GrammarSpec, pick_grammar
from decode_worker.errors import ClientError

TOOLS_UNSUPPORTED = ("tool calls are not parsed here (chat completions with a harmony model "
                     "and api.tool_call_parser auto or gpt-oss only): the server cannot parse a "
                     "tool call out of this output")


class JsonSchemaFormat(msgspec.Struct):
    """OpenAI `response_format.json_schema`."""

    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    """OpenAI `response_format`."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


def _schema_text(schema: dict[str, Any] | bool) -> str:
    """One text per schema (keys sorted): the compiled grammar is cached by it."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def grammar_from_response_format(rf: ResponseFormat | None) -> GrammarSpec | None:
    """The constraint `response_format` asks for (None for "text"). Raises ClientError."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return pick_grammar({"response_format": GrammarSpec("json_object")})
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise ClientError("response_format.json_schema.schema is required for "
                              "type 'json_schema'")
        spec = GrammarSpec("json_schema", _schema_text(rf.json_schema.schema))
        return pick_grammar({"response_format": spec})
    raise ClientError(f"response_format.type={rf.type!r}: must be 'text', 'json_object' "
                      "or 'json_schema'")


def grammar_from_sampling(json_schema: str | dict[str, Any] | None, regex: str | None,
                          ebnf: str | None) -> GrammarSpec | None:
    """SGLang's `sampling_params` constraint (at most one of the three). Raises ClientError."""
    schema: GrammarSpec | None = None
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else _schema_text(json_schema)
        schema = GrammarSpec("json_schema", text)
    return pick_grammar({
        "sampling_params.json_schema": schema,
        "sampling_params.regex": None if regex is None else GrammarSpec("regex", regex),
        "sampling_params.ebnf": None if ebnf is None else GrammarSpec("ebnf", ebnf),
    })


def refuse_tools(tools: list[Any] | None, tool_choice: Any, functions: list[Any] | None,
                 function_call: Any = None) -> None:
    """Raise ClientError (400) for a request that asks for tool calls (see the module doc)."""
    if tools and tool_choice != "none":
        raise ClientError(f"{TOOLS_UNSUPPORTED}; leave out `tools` (or send "
                          "tool_choice=\"none\")")
    if tool_choice not in (None, "none", "auto"):
        raise ClientError(f"{TOOLS_UNSUPPORTED}; tool_choice={_short(tool_choice)} asks for one")
    if functions or function_call not in (None, "none", "auto"):
        raise ClientError(f"{TOOLS_UNSUPPORTED}; leave out `functions` / `function_call`")


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
