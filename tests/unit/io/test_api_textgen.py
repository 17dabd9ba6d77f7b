"""Incremental detokenization and stop strings (pure), checked against whole-text decoding."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.io.api.textgen import IncrementalDetokenizer, TextStream
from tests.examples import examples
from tests.fakes.fake_backend import ByteTokenizer

TOK = ByteTokenizer()
ALPHABET = st.sampled_from(list("ab, é€😀\n"))


def _chunks(data: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=examples(200), deadline=None)
@given(st.text(ALPHABET, max_size=30), st.lists(st.integers(0, 200), max_size=10))
def test_deltas_concatenate_to_the_text_and_never_hold_half_a_char(
    text: str, cuts: list[int]
) -> None:
    detok = IncrementalDetokenizer(TOK)
    deltas = [detok.push(chunk) for chunk in _chunks(list(text.encode()), cuts)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=examples(300), deadline=None)
@given(st.text(ALPHABET, max_size=30), st.lists(st.integers(0, 200), max_size=10),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=3), st.booleans())
def test_stop_strings_cut_like_whole_text_search(
    text: str, cuts: list[int], stops: list[str], keep: bool
) -> None:
    stream = TextStream(TOK, stops, no_stop_trim=keep)
    out = "".join(stream.push(c) for c in _chunks(list(text.encode()), cuts)) + stream.finish()
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if hits:  # the stop string complete first wins, as seen character by character
        end, _, stop = min(hits)
        assert out == text[: end if keep else end - len(stop)]
        assert stream.stopped and stream.matched == stop
    else:
        assert out == text and not stream.stopped
    assert out == stream.text


def test_partial_stop_string_is_held_back_until_it_fails() -> None:
    stream = TextStream(TOK, ["END"])
    assert stream.push(b"abcE") == "abc"
    assert stream.push(b"N") == ""
    assert stream.push(b"x") == "ENx"
    assert stream.push(b"yEND tail") == "y" and stream.stopped
    assert stream.push(b"more") == "" and stream.finish() == ""


def test_held_text_is_released_at_finish() -> None:
    stream = TextStream(TOK, ["END"])
    assert stream.push(b"xEN") == "x"
    assert stream.finish() == "EN"


def test_real_byte_level_tokenizer_streams_whole_characters() -> None:
    from decode_worker.device.default_model import byte_tokenizer
    from decode_worker.device.tokenizer import Tokenizer

    tok = Tokenizer(byte_tokenizer(), (256,))
    text = "héllo € 😀 done"
    stream = TextStream(tok, ["done"])
    deltas = [stream.push([i]) for i in tok.encode(text)]
    deltas.append(stream.finish())
    assert "".join(deltas) == "héllo € 😀 " and stream.matched == "done"
    assert all("\ufffd" not in d for d in deltas)
