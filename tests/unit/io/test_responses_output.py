"""Responses output items and stream events from harmony ids (`responses/output.py`,
`responses/shape.py`) and a Responses body as chat-template messages (`responses/inputs.py`).

The stream of every script, split at every boundary, must rebuild (event by event, as the
OpenAI SDK's stream state does) exactly the output of the whole answer."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from decode_worker.device.default_model import EOS_TOKEN_IDS, byte_tokenizer
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.errors import ClientError
from decode_worker.io.api.harmony import HarmonyParser, HarmonyTokens
from decode_worker.io.api.responses import inputs
from decode_worker.io.api.responses.output import Event, OutputBuilder
from tests.fakes.fake_harmony import SCRIPTS

TOK = Tokenizer(byte_tokenizer(), EOS_TOKEN_IDS)
T = HarmonyTokens.of(TOK)
assert T is not None
CUT_CALL = SCRIPTS["call"][:-len('unit": "celsius"}<|call|>')]


def run(pieces: list[list[int]], cut: bool = False) -> tuple[OutputBuilder, list[Event],
                                                              HarmonyParser]:
    """Feed `pieces` (one step each) as the stream does; the last one finishes."""
    n, m = itertools.count(), itertools.count()
    parser = HarmonyParser(T, TOK, call_id=lambda: f"call_{next(n)}")  # type: ignore[arg-type]
    builder = OutputBuilder(new_id=lambda kind: f"{kind}_{next(m)}")
    events: list[Event] = []
    for k, piece in enumerate(pieces):
        deltas = parser.push(piece)
        if k == len(pieces) - 1:
            deltas += parser.finish()
        events += builder.add(deltas, parser.parsed)
    events += builder.finish(cut)
    return builder, events, parser


def rebuild(events: list[Event]) -> list[dict[str, Any]]:
    """The output as a client assembles it from the events alone, checking their order."""
    items: dict[int, dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    for ev in events:
        kind, k = ev["type"], ev.get("output_index")
        if kind == "response.output_item.added":
            assert k == len(items) and all(i in done for i in items)  # one open item at a time
            items[k] = {**ev["item"], "text": ""}
        elif kind.endswith(".delta"):
            assert k in items and k not in done and ev["item_id"] == items[k]["id"]
            items[k]["text"] += ev["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert ev["text"] == items[k]["text"]
        elif kind == "response.function_call_arguments.done":
            assert ev["arguments"] == items[k]["text"] and ev["name"] == items[k]["name"]
        elif kind == "response.output_item.done":
            done[k] = ev["item"]
    assert sorted(done) == sorted(items)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return [done[k] for k in sorted(done)]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_stream_split_at_every_boundary_rebuilds_the_whole_output(script: str) -> None:
    ids = TOK.encode(SCRIPTS[script])
    whole, whole_events, _ = run([ids])
    want = whole.output()
    assert rebuild(whole_events) == want
    for cut in range(1, len(ids)):
        builder, events, _ = run([ids[:cut], ids[cut:]])
        assert rebuild(events) == want == builder.output(), cut
    one_by_one, events, _ = run([[t] for t in ids])
    assert rebuild(events) == want == one_by_one.output()


def test_items_of_a_call_turn() -> None:
    builder, _, parser = run([TOK.encode(SCRIPTS["two"])])
    out = builder.output()
    assert [o["type"] for o in out] == ["reasoning", "function_call", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": (
        "The user asks about the weather; call the tool.")}] and out[0]["summary"] == []
    assert [(o["name"], o["arguments"], o["status"]) for o in out[1:]] == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}', "completed"),
        ("get_time", '{"tz": "Europe/Paris"}', "completed")]
    assert [o["call_id"] for o in out[1:]] == ["call_0", "call_1"]
    reasoning_ids = TOK.encode("The user asks about the weather; call the tool.")
    assert parser.num_reasoning_tokens == len(reasoning_ids)


def test_a_cut_call_is_incomplete_and_the_finished_items_are_not() -> None:
    builder, events, _ = run([TOK.encode(CUT_CALL)], cut=True)
    out = builder.output()
    assert [(o["type"], o["status"]) for o in out] == [("reasoning", "completed"),
                                                       ("function_call", "incomplete")]
    assert out[1]["arguments"] == '{"city": "Paris", "'
    assert rebuild(events) == out


def test_a_message_cut_by_the_limit_is_incomplete() -> None:
    text = SCRIPTS["answer"][:-len("°C.<|return|>")]
    out = run([TOK.encode(text)], cut=True)[0].output()
    assert [(o["type"], o["status"]) for o in out] == [("message", "incomplete")]
    assert out[0]["content"][0]["text"] == "Sunny, 22 "


# -- the request as chat messages ---------------------------------------------------------

def test_items_become_turns_for_the_template() -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "sunny"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Sunny."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
    ]
    assert inputs.chat_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    assert inputs.chat_messages(None, "hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("items, words", [
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "no function_call"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "'input_image' is not supported"),
    ([{"type": "item_reference", "id": "msg_1"}], "'item_reference' is not supported"),
    ([{"role": "robot", "content": "x"}], "role='robot'"),
    ([], "input is required"),
])
def test_bad_items_are_400s_naming_them(items: list[Any], words: str) -> None:
    with pytest.raises(ClientError, match=words):
        inputs.chat_messages(None, items)


def test_tools_choice_and_format_take_the_chat_shapes() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    assert inputs.chat_tools([tool]) == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": True}}]
    with pytest.raises(ClientError, match="tool type 'code_interpreter' is not supported"):
        inputs.chat_tools([tool, {"type": "code_interpreter"}])
    assert inputs.chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function", "function": {"name": "f"}}
    assert inputs.chat_tool_choice("required") == "required"
    with pytest.raises(ClientError, match="tool_choice="):
        inputs.chat_tool_choice({"type": "web_search_preview"})
    fmt = inputs.response_format({"type": "json_schema", "name": "p", "schema": {"type": "object"}})
    assert fmt is not None and fmt.json_schema is not None
    assert fmt.json_schema.schema == {"type": "object"}
    with pytest.raises(ClientError, match="text.format.type"):
        inputs.response_format({"type": "yaml"})
