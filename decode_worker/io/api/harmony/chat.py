"""Parsed output as OpenAI chat answers: the message, the stream deltas, the finish reason.

Two output formats: harmony (gpt-oss, `parser.py`) and text markers (Qwen3's `<think>` and
`<tool_call>`, Llama 3.x JSON calls: `textchat/`); which one, and whether reasoning and calls
are parsed, is `textchat/select.py`'s choice from the tokenizer and `api.reasoning_parser` /
`api.tool_call_parser`. What follows is said of harmony; the text formats split the same way
(reasoning before `</think>`, calls from their blocks). Per request:
- `separate_reasoning` (SGLang's field, default true): the analysis channel goes to
  `message.reasoning_content`, the final channel (and commentary without a recipient) to
  `content`. False: no split; without tools the answer is the raw text, as `/generate` returns
  it (`skip_special_tokens`, default true; false keeps the harmony markers, what SGLang's gpt-oss
  server returns); with tools the analysis text stays in `content`, ahead of the answer.
- tool calls are parsed when the request has tools and `tool_choice` is not "none":
  `message.tool_calls` (id, name, arguments as JSON text) and `finish_reason: "tool_calls"`.
A call cut by `max_tokens` (OpenAI's behaviour) is still a tool call, plain and streamed
alike: `tool_calls` with the arguments generated so far (not whole JSON), and the finish reason
"length" says it was cut (only a turn that ended on its own with whole calls says
"tool_calls"). A call cut inside its header (no name yet) is not a call: its text is content.
Stop strings end generation as everywhere (matched on the raw text) and are applied to
`reasoning_content` and `content` each (`StopFilter`: trimmed unless `no_stop_trim`), not to
tool-call arguments. `/generate` and `/v1/completions` are never parsed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decode_worker.io.api.backend import Tokenizer
from decode_worker.io.api.harmony.parser import Delta, HarmonyParser, Kind, Parsed, parse
from decode_worker.io.api.harmony.tokens import HarmonyTokens
from decode_worker.io.api.textchat.formats import parse_text
from decode_worker.io.api.textchat.parser import TextChatParser
from decode_worker.io.api.textchat.select import Format, calls_on, check_parsers, reasoning_on
from decode_worker.io.api.textgen import StopFilter

__all__ = ["ChatParsing", "ChatStream", "chat_message", "chat_parsing", "check_parsers",
           "finish_reason", "make_parser", "parser_on"]


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """How one chat request's output is parsed. `names`: the functions the request offers
    (text formats drop a call of another, as SGLang does; None: any)."""

    tokens: Format
    reasoning: bool  # analysis -> reasoning_content (else it stays in content)
    calls: bool  # tool calls parsed (else their text is content)
    names: frozenset[str] | None = None


def parser_on(setting: str, tokens: Format | None) -> bool:
    """Whether the tool-call parser `setting` is on for this tokenizer's format."""
    return setting != "none" and calls_on(setting, tokens)


def chat_parsing(tokens: Format | None, reasoning_parser: str, separate_reasoning: bool,
                 tool_call_parser: str, parse_calls: bool,
                 names: frozenset[str] | None = None) -> ChatParsing | None:
    """The request's parsing, or None: the raw text (see the module doc)."""
    if tokens is None:
        return None
    reasoning = reasoning_on(reasoning_parser, tokens) and separate_reasoning
    calls = parser_on(tool_call_parser, tokens) and parse_calls
    if not (reasoning or calls):
        return None
    return ChatParsing(tokens, reasoning, calls, names)


def make_parser(parsing: ChatParsing, tokenizer: Tokenizer) -> HarmonyParser | TextChatParser:
    """The streaming parser of `parsing`'s format."""
    if isinstance(parsing.tokens, HarmonyTokens):
        return HarmonyParser(parsing.tokens, tokenizer, parse_calls=parsing.calls)
    return TextChatParser(parsing.tokens, tokenizer, reasoning=parsing.reasoning,
                          parse_calls=parsing.calls, names=_names(parsing),
                          eos_ids=tokenizer.eos_token_ids)


def _names(parsing: ChatParsing) -> set[str] | None:
    return None if parsing.names is None else set(parsing.names)


def chat_message(output_ids: list[int], parsing: ChatParsing, tokenizer: Tokenizer,
                 stop: Sequence[str] = (), no_stop_trim: bool = False,
                 ) -> tuple[dict[str, Any], bool]:
    """A whole output's `message` and whether it holds a whole tool call (`finish_reason`)."""
    if isinstance(parsing.tokens, HarmonyTokens):
        parsed = parse(output_ids, parsing.tokens, tokenizer, parse_calls=parsing.calls)
    else:
        parser = make_parser(parsing, tokenizer)
        assert isinstance(parser, TextChatParser)
        parser.ids = list(output_ids)
        parsed = parse_text(parser.text(), parsing.tokens, reasoning=parsing.reasoning,
                            calls=parsing.calls, names=_names(parsing))
    return message_of(parsed, parsing, stop, no_stop_trim)


def message_of(parsed: Parsed, parsing: ChatParsing, stop: Sequence[str] = (),
               no_stop_trim: bool = False) -> tuple[dict[str, Any], bool]:
    reasoning, content = parsed.reasoning, parsed.content
    if not parsing.reasoning:
        reasoning, content = "", reasoning + content
    reasoning = StopFilter(stop, no_stop_trim).push(reasoning, final=True)
    content = StopFilter(stop, no_stop_trim).push(content, final=True)
    calls = parsed.calls  # a cut one too: the stream sent its pieces (module docstring)
    msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    return msg, any(c.complete for c in calls)


class ChatStream:
    """One sample's stream: each step's tokens -> the OpenAI `delta` they add."""

    def __init__(self, parsing: ChatParsing, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 no_stop_trim: bool = False) -> None:
        self.parsing = parsing
        self.parser = make_parser(parsing, tokenizer)
        self._filters: dict[Kind, StopFilter] = {
            "reasoning": StopFilter(stop, no_stop_trim), "content": StopFilter(stop, no_stop_trim)}

    def delta(self, token_ids: list[int], last: bool) -> dict[str, Any]:
        """The delta of one step ({} when it added nothing visible yet)."""
        deltas = self.parser.push(token_ids)
        if last:
            deltas += self.parser.finish()
        shown = []
        for d in deltas:
            if d.kind in ("reasoning", "content"):
                kind: Kind = d.kind if self.parsing.reasoning else "content"
                d = Delta(kind, self._filters[kind].push(d.text))
            shown.append(d)
        if last:  # what the filters held back was no stop string
            shown += [Delta(k, f.push("", final=True)) for k, f in self._filters.items()]
        return delta_of([d for d in shown if d.text or d.kind == "call"],
                         self.parsing.reasoning)

    @property
    def made_calls(self) -> bool:
        return any(c.complete for c in self.parser.parsed.calls)


def delta_of(deltas: list[Delta], separate_reasoning: bool) -> dict[str, Any]:
    """OpenAI's chunk `delta`: reasoning_content, content, tool_calls (a call's index, id,
    type and name in its first piece; arguments in pieces)."""
    out: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.kind == "reasoning" and separate_reasoning:
            out["reasoning_content"] = out.get("reasoning_content", "") + d.text
        elif d.kind in ("reasoning", "content"):
            out["content"] = out.get("content", "") + d.text
        elif d.kind == "call":
            calls[d.index] = {"index": d.index, "id": d.call_id, "type": "function",
                              "function": {"name": d.text, "arguments": ""}}
        else:
            entry = calls.setdefault(d.index, {"index": d.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += d.text
    if calls:
        out["tool_calls"] = list(calls.values())
    return out


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """"tool_calls" for a turn that ended on its own with a call in it."""
    return "tool_calls" if made_calls and reason == "stop" else reason
