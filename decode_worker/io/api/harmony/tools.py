"""A chat request's `tools` and `tool_choice` when tool calls are parsed (harmony).

- `tools`: OpenAI function tools (`{"type": "function", "function": {"name", "description",
  "parameters"}}`); anything else is a 400 naming the entry. They go to the chat template.
- `tool_choice`: "auto" (the default with tools) lets the model choose; "none" leaves the tools
  out of the prompt and parses no call; "required" or a named function
  (`{"type": "function", "function": {"name": ...}}`) is enforced with a grammar
  (`forced_call_grammar`): the turn must be one tool call, `<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>` + arguments matching the tool's `parameters`
  + `<|call|>`. The forced turn has no analysis message: enforcement stays bounded (a reasoning
  message could run to max_tokens before the call), as xgrammar's forced harmony format does
  with reasoning disabled. The grammar is compiled where structured output is (device/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from decode_worker.core.sampling import GrammarSpec
from decode_worker.errors import ClientError
from decode_worker.io.api.harmony.tokens import HarmonyTokens
from decode_worker.io.api.structured import _short
from decode_worker.io.api.textchat.formats import TextFormat
from decode_worker.io.api.textchat.select import text_call_grammar

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean for the prompt and the output."""

    tools: list[dict[str, Any]] | None  # for the chat template (None: no tools rendered)
    parse_calls: bool  # tool calls are parsed out of the output
    grammar: GrammarSpec | None  # the forced call ("required" or a named function)


def plan_tools(tools: list[Any] | None, tool_choice: Any,
               tokens: HarmonyTokens | TextFormat) -> ToolPlan:
    """Validate `tools` / `tool_choice` and plan the request (the forced call in the syntax of
    `tokens`' format: harmony, or a text format's, `textchat/select.py`). Raises ClientError
    (400)."""
    checked = [_check_tool(k, tool) for k, tool in enumerate(tools or [])]
    names = [tool["function"]["name"] for tool in checked]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none" or not checked:
        if choice not in ("none", "auto"):
            raise ClientError(f"tool_choice={_short(choice)} needs `tools`")
        return ToolPlan(None, False, None)
    if choice == "auto":
        return ToolPlan(checked, True, None)
    if choice == "required":
        return ToolPlan(checked, True, _forced(checked, tokens))
    name = _named(choice)
    if name not in names:
        raise ClientError(f"tool_choice names function {name!r}, which is not in `tools` "
                          f"({', '.join(names)})")
    return ToolPlan(checked, True, _forced(
        [t for t in checked if t["function"]["name"] == name], tokens))


def _forced(tools: list[dict[str, Any]], tokens: HarmonyTokens | TextFormat) -> GrammarSpec:
    if isinstance(tokens, HarmonyTokens):
        return forced_call_grammar(tools, tokens)
    return text_call_grammar(tools, tokens)


def _check_tool(k: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ClientError(f"{where}: only function tools are supported "
                          "({\"type\": \"function\", \"function\": {...}})")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ClientError(f"{where}.function.name is required")
    if not all(c.isalnum() or c in "_-" for c in fn["name"]):
        raise ClientError(f"{where}.function.name {fn['name'][:64]!r}: letters, digits, _ and -")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ClientError(f"{where}.function.parameters must be a JSON Schema object")
    return {"type": "function", "function": fn}


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
        raise ClientError(f"tool_choice={_short(choice)}: must be \"auto\", \"none\", "
                          "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    return str(fn["name"])


def forced_call_grammar(tools: list[dict[str, Any]], tokens: HarmonyTokens) -> GrammarSpec:
    """A structural tag (xgrammar's JSON form) for one call of one of `tools` (see the module
    doc); special tokens by id, the arguments by each tool's `parameters`."""
    calls = [{"type": "sequence", "elements": [
        {"type": "const_string", "value": f"{tool['function']['name']} "},
        {"type": "token", "token": tokens.constrain},
        {"type": "const_string", "value": "json"},
        {"type": "token", "token": tokens.message},
        {"type": "json_schema",
         "json_schema": tool["function"].get("parameters") or ANY_OBJECT},
    ]} for tool in tools]
    fmt = {"type": "sequence", "elements": [
        {"type": "token", "token": tokens.channel},
        {"type": "const_string", "value": "commentary to=functions."},
        calls[0] if len(calls) == 1 else {"type": "or", "elements": calls},
        {"type": "token", "token": tokens.call},
    ]}
    source = json.dumps({"type": "structural_tag", "format": fmt}, sort_keys=True)
    return GrammarSpec("structural_tag", source)



def tool_names(plan: ToolPlan | None) -> frozenset[str] | None:
    """The function names a plan offers (None: no tools parsed)."""
    if plan is None or plan.tools is None:
        return None
    return frozenset(str(t["function"]["name"]) for t in plan.tools)
