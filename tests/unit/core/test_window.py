"""SWA window arithmetic: the worked case, the margin, and the decode-time peak."""

from __future__ import annotations

import pytest

from decode_worker.core.window import (
    max_full_pages,
    max_reuse_len,
    swa_peak_pages,
    swa_slide_at,
    swa_tail_len,
    swa_tail_pages,
    swa_window_start,
)
from decode_worker.utils.mathx import align_down

CASES = [(w, p) for p in (1, 2, 4, 16, 64, 128) for w in (1, 3, 5, 31, 63, 100, 127, 128)]


def test_worked_case_895_page_64_window_127() -> None:
    assert swa_window_start(895, 127, 64, radix_cache=True) == 704
    assert swa_tail_len(895, 127, 64, radix_cache=True) == 191
    assert swa_tail_pages(895, 127, 64, radix_cache=True) == 3


def test_without_radix_cache_start_is_seq_minus_window_rounded_down() -> None:
    assert swa_window_start(895, 127, 64, radix_cache=False) == 768
    assert swa_window_start(100, 127, 64, radix_cache=False) == 0


@pytest.mark.parametrize(("window", "page"), CASES)
def test_margin_keeps_a_page_aligned_matchable_window(window: int, page: int) -> None:
    for seq_len in range(0, 6 * (window + page)):
        s = swa_window_start(seq_len, window, page, radix_cache=True)
        boundary = align_down(seq_len, page)
        assert s % page == 0
        assert s <= max(0, seq_len - window)  # the next query sees its whole window
        if s > 0:
            assert boundary - s >= window  # the inserted live SWA leaf covers one window


@pytest.mark.parametrize(("window", "page"), CASES)
def test_start_equals_contract_formula_when_it_keeps_the_margin(window: int, page: int) -> None:
    for seq_len in range(0, 4 * (window + page)):
        contract = align_down(max(0, seq_len - 1 - max(window, page)), page)
        s = swa_window_start(seq_len, window, page, radix_cache=True)
        if contract == 0 or align_down(seq_len, page) - contract >= window:
            assert s == contract


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize(("window", "page"), CASES)
def test_window_start_is_monotone_and_peak_bounds_live_pages(
    window: int, page: int, radix: bool
) -> None:
    peak = swa_peak_pages(window, page, radix)
    prev = 0
    for n in range(0, 8 * (window + page)):
        s = swa_window_start(n, window, page, radix)
        assert s >= prev
        prev = s
        assert n // page - s // page + 1 <= peak


def test_max_reuse_len_is_the_aligned_len_with_or_without_swa() -> None:
    assert max_reuse_len(895, 127, 64, radix_cache=True, has_swa=True) == 832
    assert max_reuse_len(895, 127, 64, radix_cache=True, has_swa=False) == 832
    assert max_reuse_len(895, 127, 64, radix_cache=False, has_swa=True) == 0


def test_max_full_pages_excludes_the_last_sampled_token() -> None:
    assert max_full_pages(64, 1, 64) == 1
    assert max_full_pages(64, 2, 64) == 2
    assert max_full_pages(63, 2, 64) == 1


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize(("window", "page"), [(127, 64), (127, 16), (5, 4), (7, 4), (100, 256)])
def test_peak_bounds_pages_referenced_over_a_whole_request(
    window: int, page: int, radix: bool
) -> None:
    peak = swa_peak_pages(window, page, radix)
    span = window + page
    for prompt in range(1, 2 * span, max(1, page // 16)):
        start = swa_window_start(prompt, window, page, radix)
        locked_to = align_down(prompt, page) if radix else 0
        for n in range(prompt, prompt + 2 * span + page):
            f = swa_window_start(n, window, page, radix)
            lo = f if f >= locked_to else min(start, f)
            assert n // page - lo // page + 1 <= peak


@pytest.mark.parametrize(("window", "page"), CASES)
@pytest.mark.parametrize("radix", [True, False])
def test_slide_at_is_the_first_length_whose_window_start_reaches_the_target(
        window: int, page: int, radix: bool) -> None:
    for target in range(page, 6 * (window + page), page):
        at = swa_slide_at(target, window, page, radix)
        assert swa_window_start(at, window, page, radix) >= target
        assert swa_window_start(at - 1, window, page, radix) < target
