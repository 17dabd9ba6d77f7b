"""Which output format a chat's parsers read, from the tokenizer and `api.reasoning_parser` /
`api.tool_call_parser` (SGLang's `--reasoning-parser` / `--tool-call-parser` names):

    harmony (gpt-oss)      reasoning: auto, gpt-oss          tools: auto, gpt-oss
    Qwen3 (<think>)        reasoning: auto, qwen3            tools: auto, qwen25 (qwen)
    Llama 3.x              (no reasoning)                    tools: auto, llama3

`auto` takes the format the tokenizer's special tokens show; a named parser whose markers the
tokenizer lacks stops the start (`check_parsers`); `none` parses nothing. The forced call of
`tool_choice` "required" or a named function is a structural tag in the format's syntax.
"""

from __future__ import annotations

import json
from typing import Any

from decode_worker.core.sampling import GrammarSpec
from decode_worker.errors import ConfigError
from decode_worker.io.api.backend import Tokenizer
from decode_worker.io.api.harmony.tokens import HarmonyTokens
from decode_worker.io.api.textchat.formats import TOOL, TextFormat

Format = HarmonyTokens | TextFormat
REASONING_PARSERS = ("auto", "gpt-oss", "qwen3", "none")
TOOL_CALL_PARSERS = ("auto", "gpt-oss", "qwen25", "qwen", "llama3", "none")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def output_format(tokenizer: Any) -> Format | None:
    """The harmony tokens, else the text-marker format, of `tokenizer` (None: plain text)."""
    return HarmonyTokens.of(tokenizer) or TextFormat.of(tokenizer)


def reasoning_on(setting: str, fmt: Format | None) -> bool:
    if isinstance(fmt, HarmonyTokens):
        return setting in ("auto", "gpt-oss")
    return fmt is not None and fmt.reasoning and setting in ("auto", "qwen3")


def calls_on(setting: str, fmt: Format | None) -> bool:
    if isinstance(fmt, HarmonyTokens):
        return setting in ("auto", "gpt-oss")
    if fmt is None or fmt.calls is None:
        return False
    names = {"qwen25": ("qwen25", "qwen"), "llama3": ("llama3",)}[fmt.calls]
    return setting == "auto" or setting in names


def check_parsers(reasoning_parser: str, tool_call_parser: str, tokenizer: Tokenizer) -> None:
    """At startup: ConfigError for an unknown value, or a named parser whose markers the
    tokenizer lacks (it would parse nothing)."""
    fmt = output_format(tokenizer)
    for key, value, known, on in (
            ("api.reasoning_parser", reasoning_parser, REASONING_PARSERS, reasoning_on),
            ("api.tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS, calls_on)):
        if value not in known:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(known)}")
        if value not in ("auto", "none") and not on(value, fmt):
            raise ConfigError(f"{key}={value}, but the tokenizer lacks that format's special "
                              "tokens (gpt-oss: <|channel|>, ...; qwen3: <think>; qwen25: "
                              "<tool_call>; llama3: <|python_tag|>): another model family")


def text_call_grammar(tools: list[dict[str, Any]], fmt: TextFormat) -> GrammarSpec:
    """A structural tag for one call of one of `tools` in `fmt`'s syntax (Qwen:
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`; Llama 3: `{"name": ...,
    "parameters": ...}`), the arguments by each tool's `parameters`."""
    qwen = fmt.calls == "qwen25"
    key = "arguments" if qwen else "parameters"
    calls = [{"type": "sequence", "elements": [
        {"type": "const_string", "value": (TOOL + "\n" if qwen else "")
         + f'{{"name": "{tool["function"]["name"]}", "{key}": '},
        {"type": "json_schema", "json_schema": tool["function"].get("parameters") or ANY_OBJECT},
        {"type": "const_string", "value": "}\n</tool_call>" if qwen else "}"},
    ]} for tool in tools]
    fmt_tag = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    source = json.dumps({"type": "structural_tag", "format": fmt_tag}, sort_keys=True)
    return GrammarSpec("structural_tag", source)
