"""PageAllocator: ids 1..N, never twice, typed errors that leave the allocator unchanged."""

from __future__ import annotations

import pytest

from decode_worker.core.pages import PageAllocator
from decode_worker.errors import FatalError, OutOfPages, PageError


def test_alloc_hands_out_ascending_ids_and_never_page_zero() -> None:
    pool = PageAllocator(5, "full")
    assert pool.alloc(3) == [1, 2, 3]
    assert pool.alloc(2) == [4, 5]
    assert pool.num_free == 0
    assert pool.num_total == 5


def test_alloc_more_than_free_raises_and_takes_nothing() -> None:
    pool = PageAllocator(4, "swa")
    pool.alloc(3)
    with pytest.raises(OutOfPages):
        pool.alloc(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_alloc_zero_is_empty_and_negative_raises() -> None:
    pool = PageAllocator(2, "full")
    assert pool.alloc(0) == []
    with pytest.raises(PageError):
        pool.alloc(-1)


def test_free_returns_pages_for_reuse_without_duplicates() -> None:
    pool = PageAllocator(4, "full")
    pages = pool.alloc(4)
    pool.free(pages[1:3])
    again = pool.alloc(2)
    assert sorted(again) == sorted(pages[1:3])
    pool.check_integrity()


@pytest.mark.parametrize("bad", [[0], [9], [-1]])
def test_free_out_of_range_raises(bad: list[int]) -> None:
    pool = PageAllocator(8, "full")
    pool.alloc(8)
    with pytest.raises(PageError):
        pool.free(bad)


def test_free_of_a_page_not_held_raises_and_leaves_state_unchanged() -> None:
    pool = PageAllocator(4, "full")
    held = pool.alloc(2)
    with pytest.raises(PageError):
        pool.free([held[0], 4])  # 4 was never handed out
    assert pool.num_free == 2
    assert not pool.is_free(held[0])
    pool.check_integrity()


def test_free_of_the_same_page_twice_in_one_call_raises() -> None:
    pool = PageAllocator(4, "full")
    held = pool.alloc(2)
    with pytest.raises(PageError):
        pool.free([held[0], held[0]])
    assert pool.num_free == 2
    pool.check_integrity()


def test_all_held_and_is_free() -> None:
    pool = PageAllocator(4, "full")
    held = pool.alloc(2)
    assert pool.all_held(held)
    assert not pool.all_held([*held, 3])
    assert not pool.all_held([0])
    assert pool.is_free(3)
    with pytest.raises(PageError):
        pool.is_free(5)


def test_check_integrity_catches_a_corrupted_free_list() -> None:
    pool = PageAllocator(4, "full")
    pool.alloc(2)
    pool._free.append(pool._free[0])  # simulate a bug: a page twice in the free list
    with pytest.raises(FatalError):
        pool.check_integrity()
