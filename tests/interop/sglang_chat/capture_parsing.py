"""Writes tests/data/sglang_chat_parsing.json: SGLang 0.5.23's own one-shot parses of chat
outputs (Qwen3Detector for reasoning; Qwen25Detector and Llama32Detector for tool calls), the
golden answers tests/unit/io/test_textchat.py holds decode-worker's parsers to.

Run in the SGLang venv (it never imports decode_worker):
    .venv-sglang/bin/python tests/interop/sglang_chat/capture_parsing.py
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang.srt.entrypoints.openai.protocol import Tool
from sglang.srt.function_call.llama32_detector import Llama32Detector
from sglang.srt.function_call.qwen25_detector import Qwen25Detector
from sglang.srt.parser.reasoning_parser import Qwen3Detector

OUT = Path(__file__).resolve().parents[2] / "data" / "sglang_chat_parsing.json"
CALL_F = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": 2}}'
          '\n</tool_call>')
CALL_G = '<tool_call>\n{"name": "lookup", "arguments": {"q": "caf\u00e9"}}\n</tool_call>'
CASES = [
    ("qwen3", "qwen25", "<think>\nThe user greets.\n</think>\n\nHello there."),
    ("qwen3", "qwen25", "<think>\nStill thinking about it"),
    ("qwen3", "qwen25", "No reasoning here, just text."),
    ("qwen3", "qwen25", f"<think>\nneed weather\n</think>\n\nLet me check. {CALL_F}\n{CALL_G}"),
    ("qwen3", "qwen25", f"<think>\nimplicit close\n{CALL_F}"),
    ("qwen3", "qwen25", '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>'),
    ("qwen3", "qwen25", '<tool_call>\n{"name": "lookup", "arguments": {bad json}\n</tool_call>'),
    ("qwen3", "qwen25", "<think><think>doubled\n</think>done"),
    ("qwen3", "qwen25", f"Text before\n{CALL_F}\ntrailing"),
    (None, "llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (None, "llama3", '{"name": "get_weather", "parameters": {"city": "Rome"}};'
                     '{"name": "lookup", "arguments": {"q": "x"}}'),
    (None, "llama3", "Plain answer with no call."),
    (None, "llama3", 'Sure.<|python_tag|>{"name": "lookup", "parameters": {"q": "y"}}'),
]
NAMES = ["get_weather", "lookup"]


def main() -> int:
    tools = [Tool(type="function", function={"name": n, "parameters": {"type": "object"}})
             for n in NAMES]
    out = []
    for reasoning_fmt, calls_fmt, text in CASES:
        reasoning, rest = "", text
        if reasoning_fmt == "qwen3":
            r = Qwen3Detector().detect_and_parse(text)
            reasoning, rest = r.reasoning_text or "", r.normal_text or ""
        det = Qwen25Detector() if calls_fmt == "qwen25" else Llama32Detector()
        res = det.detect_and_parse(rest, tools)
        out.append({"reasoning_parser": reasoning_fmt, "tool_call_parser": calls_fmt,
                    "text": text, "tools": NAMES, "reasoning": reasoning,
                    "content": res.normal_text,
                    "calls": [[c.name, c.parameters] for c in res.calls]})
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} cases to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
