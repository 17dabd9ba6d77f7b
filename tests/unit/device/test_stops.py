"""Stop-string helpers."""

from __future__ import annotations

from decode_worker.device.stops import find_stop, safe_prefix_len, search_start, trim_at_stop


def test_find_stop_earliest_then_longest() -> None:
    assert find_stop("abc STOP def END", ["END", "STOP"]) == (4, "STOP")
    assert find_stop("xxab", ["a", "ab", "abc"]) == (2, "ab")
    assert find_stop("hello", ["z"]) is None
    assert find_stop("ab ab", ["ab"], start=1) == (3, "ab")


def test_safe_prefix_holds_back_a_possible_stop_start() -> None:
    assert safe_prefix_len("hello wor", ["world"]) == len("hello ")
    assert safe_prefix_len("hello", ["xyz"]) == 5
    assert safe_prefix_len("", ["ab"]) == 0


def test_search_start_and_trim() -> None:
    assert search_start(10, ["abc", "de"]) == 8
    assert trim_at_stop("one two three", ["two"]) == ("one ", True)
    assert trim_at_stop("one two three", ["two"], keep_stop=True) == ("one two", True)
    assert trim_at_stop("one", ["two"]) == ("one", False)
