"""A harmony (gpt-oss) output parser on token ids: reasoning, final text and tool calls.

`HarmonyParser.push(ids)` takes one step's tokens and returns what they added (`Delta`s, in
order); `finish()` ends the output; `parsed` holds everything so far. `parse(...)` runs the same
machine over a whole output, so a stream and a whole parse agree by construction, however the
ids are split.

The output of a chat turn starts right after the prompt's `<|start|>assistant`, so the parser
starts inside a message header. A message is classed by its header (`header.py`):
  analysis channel                        -> reasoning
  a recipient (`to=functions.NAME`)       -> a tool call NAME, its content the arguments
  final, commentary without recipient,    -> content
  an unknown or missing channel
Malformed output never raises, it degrades to content: text between messages, a header that
never reaches `<|message|>` (or is longer than MAX_HEADER_TOKENS: a model that does not speak
harmony), stray special tokens (dropped). A message cut by the end of the output keeps its
class; a tool call is `complete` only once `<|call|>` (or `<|end|>`, `<|return|>`) closed it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from decode_worker.io.api.backend import Tokenizer
from decode_worker.io.api.harmony.header import Header, read_header
from decode_worker.io.api.harmony.tokens import HarmonyTokens
from decode_worker.io.api.textgen import IncrementalDetokenizer

MAX_HEADER_TOKENS = 64  # a header is a few words; past this it is taken for plain text
Kind = Literal["reasoning", "content", "call", "args"]
_State = Literal["header", "content", "idle"]


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Delta:
    """What a step added. reasoning / content: `text`; call: a tool call began (`index`,
    `call_id`, its name in `text`), sent once; args: a piece of call `index`'s arguments."""

    kind: Kind
    text: str
    index: int = -1
    call_id: str = ""


@dataclass(slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class Parsed:
    """The output so far: reasoning text, content text, tool calls in order."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        if delta.kind == "reasoning":
            self.reasoning += delta.text
        elif delta.kind == "content":
            self.content += delta.text
        elif delta.kind == "call":
            self.calls.append(ToolCall(delta.index, delta.call_id, delta.text))
        else:
            self.calls[delta.index].arguments += delta.text


class HarmonyParser:
    """Incremental harmony parser (one per output). `parse_calls` False: tool calls are left
    as content (their arguments text). Not thread-safe; never raises on any id sequence."""

    def __init__(self, tokens: HarmonyTokens, tokenizer: Tokenizer, *, parse_calls: bool = True,
                 call_id: Callable[[], str] = new_call_id) -> None:
        self._t = tokens
        self._special, self._closing = tokens.all_ids, tokens.closing_ids
        self._tokenizer = tokenizer
        self._parse_calls = parse_calls
        self._call_id = call_id
        self._state: _State = "header"
        self._header: list[int] = []
        self._kind: Kind = "content"  # of the message being read (content state)
        self._detok: IncrementalDetokenizer | None = None
        self._out: list[Delta] = []  # this call's deltas
        self.parsed = Parsed()
        self.num_reasoning_tokens = 0  # text tokens of analysis messages (Responses usage)

    def push(self, ids: Sequence[int]) -> list[Delta]:
        """Feed tokens; returns the deltas they completed (text may wait for a whole
        character or a whole header)."""
        self._out = []
        for tid in ids:
            self._step(int(tid))
        return _merge(self._out)

    def finish(self) -> list[Delta]:
        """The end of the output: what is still held (a header never closed becomes content)."""
        self._out = []
        if self._state == "header":
            self._degrade_header()
        elif self._state == "content":
            self._close_message(complete=False)
        self._state = "idle"
        return _merge(self._out)

    # -- the machine ------------------------------------------------------------------------

    def _step(self, tid: int) -> None:
        if self._state == "header":
            self._in_header(tid)
        elif self._state == "content":
            self._in_content(tid)
        else:
            self._in_idle(tid)

    def _in_header(self, tid: int) -> None:
        t = self._t
        if tid == t.message:
            self._open_message(read_header(self._header, t, self._tokenizer))
        elif tid in self._closing:  # a header with no message: its text is content
            self._degrade_header()
            self._state = "idle"
        elif tid == t.start:
            self._degrade_header()
        else:
            self._header.append(tid)
            if len(self._header) > MAX_HEADER_TOKENS:  # not harmony: plain text
                self._start_content("content")
                self._text(self._header)
                self._header = []

    def _in_content(self, tid: int) -> None:
        t = self._t
        if tid in self._closing:
            self._close_message(complete=True)
            self._state = "idle"
        elif tid in (t.start, t.channel):  # a new message without the last one's <|end|>
            self._close_message(complete=False)
            self._state, self._header = "header", [tid] if tid == t.channel else []
        elif tid not in self._special:  # <|message|> / <|constrain|> here: stray, dropped
            self._text((tid,))

    def _in_idle(self, tid: int) -> None:
        t = self._t
        if tid in (t.start, t.channel):
            self._state, self._header = "header", [tid] if tid == t.channel else []
        elif tid == t.message:
            self._start_content("content")
        elif tid not in self._special:  # text between messages: content
            self._start_content("content")
            self._text((tid,))

    # -- messages ---------------------------------------------------------------------------

    def _open_message(self, header: Header) -> None:
        self._header = []
        if header.recipient is not None and self._parse_calls:
            index = len(self.parsed.calls)
            self._add(Delta("call", header.function_name, index, self._call_id()))
            self._start_content("args")
        else:
            self._start_content("reasoning" if header.channel == "analysis" else "content")

    def _start_content(self, kind: Kind) -> None:
        self._state, self._kind = "content", kind
        self._detok = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=True)

    def _close_message(self, complete: bool) -> None:
        if self._detok is not None:
            self._emit(self._detok.flush())
        if complete and self._kind == "args":
            self.parsed.calls[-1].complete = True
        self._detok = None

    def _degrade_header(self) -> None:
        if self._header:
            text = self._tokenizer.decode(self._header, skip_special_tokens=True)
            if text:
                self._add(Delta("content", text))
        self._header = []

    def _text(self, ids: Sequence[int]) -> None:
        if self._kind == "reasoning":
            self.num_reasoning_tokens += len(ids)
        if self._detok is not None:
            self._emit(self._detok.push(ids))

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._kind == "args":
            self._add(Delta("args", text, len(self.parsed.calls) - 1))
        else:
            self._add(Delta(self._kind, text))

    def _add(self, delta: Delta) -> None:
        self.parsed.add(delta)
        self._out.append(delta)


def _merge(out: list[Delta]) -> list[Delta]:
    """Adjacent text deltas of one kind (and call) joined: one step, one piece each."""
    merged: list[Delta] = []
    for d in out:
        prev = merged[-1] if merged else None
        if prev is not None and d.kind != "call" and prev.kind == d.kind and (
                prev.index == d.index):
            merged[-1] = Delta(d.kind, prev.text + d.text, d.index, d.call_id)
        else:
            merged.append(d)
    return merged


def parse(ids: Sequence[int], tokens: HarmonyTokens, tokenizer: Tokenizer, *,
          parse_calls: bool = True, call_id: Callable[[], str] = new_call_id) -> Parsed:
    """A whole output (ids after the prompt's `<|start|>assistant`), parsed."""
    parser = HarmonyParser(tokens, tokenizer, parse_calls=parse_calls, call_id=call_id)
    parser.push(ids)
    parser.finish()
    return parser.parsed
