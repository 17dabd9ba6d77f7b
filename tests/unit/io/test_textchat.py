"""Qwen3 reasoning and tool calls, Llama 3.x JSON tool calls: decode-worker's parsers against
SGLang 0.5.23's own (tests/data/sglang_chat_parsing.json, written by SGLang's Qwen3Detector,
Qwen25Detector and Llama32Detector: tests/interop/sglang_chat/capture_parsing.py), whole and
streamed token by token through the tiny Qwen3 and Llama tokenizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from decode_worker.device.tokenizer import Tokenizer
from decode_worker.io.api.textchat.formats import TextFormat, parse_text
from decode_worker.io.api.textchat.parser import TextChatParser

GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "data"
                     / "sglang_chat_parsing.json").read_text())


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    from decode_worker.device.model.tiny import write_tokenizer

    out = {}
    for family in ("qwen3", "llama"):
        path = tmp_path_factory.mktemp(family)
        write_tokenizer(path, family, 4096)
        out[family] = Tokenizer.from_dir(path)
    return out


def _fmt(case: dict[str, Any]) -> TextFormat:
    return TextFormat(case["reasoning_parser"] == "qwen3", case["tool_call_parser"])


@pytest.mark.parametrize("case", GOLDEN, ids=[c["text"][:24] for c in GOLDEN])
def test_whole_output_parses_as_sglang_parses_it(case: dict[str, Any]) -> None:
    parsed = parse_text(case["text"], _fmt(case), reasoning=True, calls=True,
                        names=set(case["tools"]))
    assert parsed.reasoning == case["reasoning"]
    assert parsed.content == case["content"]
    assert [[c.name, c.arguments] for c in parsed.calls] == case["calls"]


@pytest.mark.parametrize("case", GOLDEN, ids=[c["text"][:24] for c in GOLDEN])
def test_streamed_token_by_token_gives_the_same_calls_and_text(
        case: dict[str, Any], tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["qwen3" if case["tool_call_parser"] == "qwen25" else "llama"]
    ids = tok.encode(case["text"])
    assert tok.decode(ids, skip_special_tokens=False) == case["text"]
    parser = TextChatParser(_fmt(case), tok, reasoning=True, parse_calls=True,
                            names=set(case["tools"]))
    deltas = [d for i in ids for d in parser.push([i])] + parser.finish()
    got = {"reasoning": "", "content": "", "calls": []}
    for d in deltas:
        if d.kind in ("reasoning", "content"):
            got[d.kind] += d.text
        elif d.kind == "call":
            got["calls"].append([d.text, ""])
        else:
            got["calls"][d.index][1] += d.text
    assert got["calls"] == case["calls"]
    assert got["reasoning"] == case["reasoning"]
    assert got["content"].strip() == case["content"].strip()
    assert all(c.complete for c in parser.parsed.calls)


def test_formats_are_found_by_the_tokenizers_special_tokens(
        tokenizers: dict[str, Tokenizer]) -> None:
    assert TextFormat.of(tokenizers["qwen3"]) == TextFormat(True, "qwen25")
    assert TextFormat.of(tokenizers["llama"]) == TextFormat(False, "llama3")


TOOL = {"type": "function", "function": {"name": "lookup", "description": "Find <x> & 'y'",
                                         "parameters": {"type": "object", "properties": {
                                             "q": {"type": "string"}}, "required": ["q"]}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi café"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "42"}]


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_chat_templates_render_as_transformers_renders_them(
        family: str, tmp_path: Path) -> None:
    """The checkpoint's own template through this worker's renderer and through transformers'
    `apply_chat_template` give the same text (tools and tool turns included)."""
    transformers = pytest.importorskip("transformers")
    from decode_worker.device.model.tiny import write_tokenizer

    write_tokenizer(tmp_path, family, 4096)
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    chat = CHAT if family != "gemma3" else CHAT[:2]
    tools = [TOOL] if family != "gemma3" else None
    want = hf.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, tools=tools) == want
