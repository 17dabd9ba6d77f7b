"""Reasoning and tool calls written as text markers (Qwen3, Llama 3.x), parsed as SGLang 0.5.23
parses them (`sglang/srt/parser/reasoning_parser.py` Qwen3Detector,
`sglang/srt/function_call/qwen25_detector.py` and `llama32_detector.py`, one-shot forms):

- qwen3 reasoning: with `<think>` in the text, what follows it (leading `<think>`s dropped) up
  to `</think>` is reasoning and the rest the answer; without `</think>`, reasoning runs to a
  `<tool_call>` (which starts the answer) or to the end (a cut turn). No `<think>`: no reasoning.
- qwen25 tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
  the content is the text before the first block, stripped; a block whose JSON does not parse
  or names a function the request does not offer is dropped.
- llama3 tool calls: `<|python_tag|>` then JSON objects separated by `;`, or text that starts
  with `{`; `parameters` (or `arguments`) are the arguments; the content is the text before
  the tag.
Arguments come back as JSON text (`json.dumps(..., ensure_ascii=False)`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from decode_worker.io.api.harmony.parser import Parsed, ToolCall, new_call_id

THINK, END_THINK, TOOL, END_TOOL = "<think>", "</think>", "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
CallFormat = Literal["qwen25", "llama3"]
_QWEN_BLOCK = re.compile(re.escape(TOOL + "\n") + r"(.*?)" + re.escape("\n" + END_TOOL),
                         re.DOTALL)


@dataclass(frozen=True, slots=True)
class TextFormat:
    """Which markers one tokenizer's model writes: `<think>` reasoning (qwen3) and its tool-call
    format, found by the special tokens it has."""

    reasoning: bool
    calls: CallFormat | None

    @classmethod
    def of(cls, tokenizer: Any) -> TextFormat | None:
        """The format of `tokenizer` (anything with `token_to_id`), or None (neither)."""
        lookup = getattr(tokenizer, "token_to_id", None)
        if lookup is None:
            return None
        think = lookup(THINK) is not None and lookup(END_THINK) is not None
        calls: CallFormat | None = ("qwen25" if lookup(TOOL) is not None
                                    else "llama3" if lookup(PYTHON_TAG) is not None else None)
        return cls(think, calls) if think or calls else None

    @property
    def markers(self) -> tuple[str, ...]:
        """Marker strings a stream holds back while only a prefix of one has arrived."""
        out: tuple[str, ...] = (THINK, END_THINK) if self.reasoning else ()
        if self.calls == "qwen25":
            out += (TOOL + "\n", END_TOOL)  # a block opens with the newline too
        elif self.calls == "llama3":
            out += (PYTHON_TAG,)
        return out


def split_reasoning(text: str) -> tuple[str, str, bool]:
    """(reasoning, rest, closed) of an output as the qwen3 parser splits it; `closed`: the
    reasoning ended (`</think>`, or a `<tool_call>` that starts the answer)."""
    if THINK not in text:
        return "", text, True
    while text.startswith(THINK):
        text = text[len(THINK):]
    if END_THINK in text:
        reasoning, rest = text.split(END_THINK, 1)
        return reasoning, rest, True
    at = text.find(TOOL)
    if at != -1:
        return text[:at], text[at:], True
    return text, "", False


def parse_calls(text: str, fmt: CallFormat, names: set[str] | None
                ) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON)]) of the answer text; `names`: the offered functions
    (None: any name)."""
    if fmt == "qwen25":
        at = text.find(TOOL + "\n")
        if at == -1:
            return text, []
        objs = []
        for block in _QWEN_BLOCK.findall(text):
            try:
                objs.append(json.loads(block.strip()))
            except ValueError:
                continue
        return text[:at].strip(), _calls(objs, names)
    if PYTHON_TAG not in text and not text.startswith("{"):
        return text, []
    content, action = text.split(PYTHON_TAG, 1) if PYTHON_TAG in text else ("", text)
    return content, _calls(_json_objects(action), names)


def _json_objects(text: str) -> list[Any]:
    """JSON values separated by `;` (Llama 3's parallel calls); stops at what does not parse."""
    decoder, at, out = json.JSONDecoder(), 0, []
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text[at:])
        except ValueError:
            nxt = text.find('{"name":', at + 1)
            if nxt == -1:
                break
            at = nxt
            continue
        out.append(obj)
        at += end + 1
    return out


def _calls(objs: list[Any], names: set[str] | None) -> list[tuple[str, str]]:
    out = []
    for obj in objs:
        for act in obj if isinstance(obj, list) else [obj]:
            name = act.get("name") if isinstance(act, dict) else None
            if not isinstance(name, str) or not name or (names is not None and name not in names):
                continue  # SGLang drops a call of an undefined function
            args = act.get("parameters") or act.get("arguments", {})
            out.append((name, json.dumps(args, ensure_ascii=False)))
    return out


def parse_text(text: str, fmt: TextFormat, *, reasoning: bool, calls: bool,
               names: set[str] | None = None) -> Parsed:
    """A whole output's reasoning, content and tool calls (see the module doc)."""
    thought, rest = "", text
    if reasoning and fmt.reasoning:
        thought, rest, _ = split_reasoning(text)
    found: list[tuple[str, str]] = []
    if calls and fmt.calls is not None:
        rest, found = parse_calls(rest, fmt.calls, names)
    return Parsed(thought, rest, [ToolCall(i, new_call_id(), name, args, True)
                                  for i, (name, args) in enumerate(found)])
