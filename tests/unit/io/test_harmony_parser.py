"""The harmony parser on token ids built with the tiny model's tokenizer (its harmony special
tokens are single ids): reasoning, content, tool calls, malformed and cut output, and streams
split anywhere parse like the whole output."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.device.default_model import EOS_TOKEN_IDS, byte_tokenizer
from decode_worker.device.tokenizer import Tokenizer
from decode_worker.io.api.harmony import HarmonyParser, HarmonyTokens, Parsed, parse
from decode_worker.io.api.harmony.chat import ChatParsing, delta_of, message_of
from tests.examples import examples

TOK = Tokenizer(byte_tokenizer(), EOS_TOKEN_IDS)
T = HarmonyTokens.of(TOK)
assert T is not None
ANALYSIS = "<|channel|>analysis<|message|>The user wants weather. Use the tool.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny — 22 °C.<|return|>"


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def counter_ids() -> itertools.count[int]:
    return itertools.count()


def whole(text_or_ids: str | list[int], parse_calls: bool = True) -> Parsed:
    seq = ids(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    n = counter_ids()
    return parse(seq, T, TOK, parse_calls=parse_calls, call_id=lambda: f"call_{next(n)}")


def test_tokenizer_has_the_harmony_tokens_as_single_ids() -> None:
    assert T is not None and len(T.all_ids) == 7 and min(T.all_ids) >= 256
    assert ids("<|channel|>") == [T.channel] and ids("<|call|>") == [T.call]
    assert HarmonyTokens.of(object()) is None


def test_reasoning_then_final() -> None:
    got = whole(ANALYSIS + FINAL)
    assert got.reasoning == "The user wants weather. Use the tool."
    assert got.content == "It is sunny — 22 °C." and got.calls == []


def test_reasoning_then_tool_call() -> None:
    got = whole(ANALYSIS + CALL)
    assert got.reasoning.startswith("The user wants") and got.content == ""
    [call] = got.calls
    assert (call.index, call.id, call.name) == (0, "call_0", "get_weather")
    assert call.arguments == '{"city": "Paris"}' and call.complete


def test_two_tool_calls_and_the_recipient_before_the_channel() -> None:
    second = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
              '{"tz": "CET"}<|call|>')
    got = whole(CALL[len("<|start|>assistant"):] + second)
    assert [(c.index, c.name, c.arguments, c.complete) for c in got.calls] == [
        (0, "get_weather", '{"city": "Paris"}', True), (1, "get_time", '{"tz": "CET"}', True)]
    assert got.calls[0].id != got.calls[1].id


def test_commentary_without_recipient_is_content_and_calls_can_be_left_as_text() -> None:
    pre = "<|channel|>commentary<|message|>Checking the weather.<|end|>"
    assert whole(pre + CALL).content == "Checking the weather."
    raw = whole(pre + CALL, parse_calls=False)
    assert raw.calls == [] and raw.content == 'Checking the weather.{"city": "Paris"}'


@pytest.mark.parametrize("cut", [5, 20, 45])
def test_a_cut_turn_keeps_what_it_had(cut: int) -> None:
    seq = ids(ANALYSIS + CALL)
    analysis_len = len(ids(ANALYSIS))
    got = whole(seq[: analysis_len + cut])
    assert got.reasoning == "The user wants weather. Use the tool."
    if got.calls:  # cut inside the arguments: a call, not complete
        assert not got.calls[0].complete and '{"city": "Paris"}'.startswith(
            got.calls[0].arguments)
    else:  # cut inside the header: the header text is content
        assert got.content and "<|" not in got.content
    msg, made_calls = message_of(got, ChatParsing(T, True, True))
    assert not made_calls  # the finish reason stays "length"
    if got.calls:  # a cut call stays a call with what it had (as the stream sent it)
        [call] = msg["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": got.calls[0].arguments}
        assert msg["content"] is None
    else:
        assert "tool_calls" not in msg and msg["content"] == got.content


def test_cut_inside_a_character_never_splits_it() -> None:
    seq = ids(FINAL)
    got = whole(seq[:-4])  # inside "°C." the bytes of ° are whole or absent
    assert "\ufffd" not in got.content[:-1]


def test_garbage_between_channels_and_stray_tokens_degrade_to_content() -> None:
    text = (ANALYSIS + "garbage!" + "<|end|><|constrain|>" + FINAL + "<|message|>tail")
    got = whole(text)
    assert got.reasoning.startswith("The user") and got.calls == []
    assert got.content == "garbage!It is sunny — 22 °C.tail"


def test_output_that_is_not_harmony_is_content() -> None:
    assert whole("plain answer, no channels").content == "plain answer, no channels"
    long = "x" * 200  # past MAX_HEADER_TOKENS: streamed as content, not held as a header
    parser = HarmonyParser(T, TOK)
    streamed = "".join(d.text for d in parser.push(ids(long)))
    assert streamed == long and parser.finish() == []


def test_a_missing_channel_and_a_missing_end() -> None:
    got = whole("<|message|>no header<|start|>assistant<|channel|>final<|message|>done")
    assert got.content == "no headerdone" and got.reasoning == ""


def test_stream_deltas_carry_the_call_name_once_and_arguments_in_pieces() -> None:
    parser = HarmonyParser(T, TOK, call_id=lambda: "call_x")
    deltas = [delta_of(parser.push([tid]), True) for tid in ids(ANALYSIS + CALL)]
    deltas.append(delta_of(parser.finish(), True))
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    named = [c for c in calls if "id" in c]
    assert named == [{"index": 0, "id": "call_x", "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert len([c for c in calls if c["function"]["arguments"]]) > 1  # in pieces
    assert "".join(d.get("reasoning_content", "") for d in deltas).startswith("The user")


PIECES = [ANALYSIS, CALL, FINAL, "<|start|>assistant<|channel|>final<|message|>ok<|end|>",
          "stray text", "<|end|>", "<|message|>", "<|channel|>", "<|start|>", "<|constrain|>json",
          "é😀", " to=functions.f ", "<|call|>", "<|return|>"]


@settings(max_examples=examples(150), deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=6),
       cut=st.integers(min_value=0, max_value=400), data=st.data())
def test_a_stream_split_anywhere_parses_like_the_whole(parts: list[str], cut: int,
                                                       data: st.DataObject) -> None:
    seq = ids("".join(parts))[:cut] if cut else ids("".join(parts))
    bounds = sorted(data.draw(st.lists(st.integers(0, len(seq)), max_size=len(seq) + 1)))
    n = counter_ids()
    parser = HarmonyParser(T, TOK, call_id=lambda: f"call_{next(n)}")
    folded = Parsed()
    for a, b in itertools.pairwise([0, *bounds, len(seq)]):
        for d in parser.push(seq[a:b]):
            folded.add(d)
    for d in parser.finish():
        folded.add(d)
    want = whole(seq)
    assert parser.parsed == want  # complete flags too
    assert _view(folded) == _view(want)  # the deltas alone carry everything else


def _view(p: Parsed) -> tuple[str, str, list[tuple[int, str, str, str]]]:
    return p.reasoning, p.content, [(c.index, c.id, c.name, c.arguments) for c in p.calls]
