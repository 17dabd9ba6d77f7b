"""Unified radix tree: one test per operation and per tricky case (page size 4, window 7)."""

from __future__ import annotations

import pytest

from decode_worker.core.radix_tree import MatchMode
from decode_worker.core.req_kv import ReqKV
from decode_worker.errors import PageError
from tests.unit.core.radix_helpers import PS, admit, check, finish, make_tree


def test_empty_tree_matches_nothing() -> None:
    tree = make_tree()
    res = tree.match_prefix(list(range(20)), MatchMode.TRANSFER)
    assert (res.prefix_len, res.full_page_ids, res.node) == (0, [], tree.root)
    check(tree)


def test_insert_then_match_is_page_aligned_and_returns_the_pages() -> None:
    tree = make_tree()
    kv = admit(tree, list(range(18)), swa_start=8)
    pages = list(kv.full_page_ids)
    tree.cache_finished_req(kv)  # 4 pages cached, the partial 5th page freed
    res = tree.match_prefix(list(range(18)), MatchMode.TRANSFER)
    assert res.prefix_len == 16 and res.full_page_ids == pages[:4]
    assert res.swa_page_ids[:2] == [0, 0] and all(res.swa_page_ids[2:])
    assert tree.full_stats().available == 64 - 4
    check(tree)


def test_divergence_inside_a_node_splits_at_the_page_boundary() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=8)
    other = [*range(9), 99, 99, 99, 99, 99, 99, 99]  # differs inside page 2
    res = tree.match_prefix(other, MatchMode.TRANSFER)
    assert res.prefix_len == 8  # pages 0 and 1 only; a partial page never matches
    assert res.node.parent is tree.root and len(res.node.key) == 2
    assert len(res.node.children) == 1
    check(tree)


def test_transfer_match_is_capped_at_max_len_and_splits_there() -> None:
    tree = make_tree()
    finish(tree, list(range(24)), swa_start=8)
    res = tree.match_prefix(list(range(24)), MatchMode.TRANSFER, max_len=11)
    assert res.prefix_len == 8 and len(res.full_page_ids) == 2
    lock = tree.lock(res.node)
    assert tree.full_stats().protected == 2
    tree.unlock(lock)
    check(tree)


def test_transfer_ignores_tombstones_but_resume_needs_a_live_window() -> None:
    tree = make_tree()
    finish(tree, list(range(24)), swa_start=8)
    assert tree.match_prefix(list(range(24)), MatchMode.RESUME).prefix_len == 24
    tree.evict_swa(100)  # everything tombstoned, full stays
    assert tree.swa_stats().evictable == 0
    assert tree.match_prefix(list(range(24)), MatchMode.TRANSFER).prefix_len == 24
    assert tree.match_prefix(list(range(24)), MatchMode.RESUME).prefix_len == 0
    check(tree)


def test_resume_stops_at_the_deepest_end_with_a_window_of_live_swa() -> None:
    tree = make_tree()
    finish(tree, list(range(20)), swa_start=0)  # 5 live pages, leaf capped to 2
    finish(tree, list(range(32)), swa_start=28)  # [20, 28) tombstone, [28, 32) live: 4 < 7
    assert tree.match_prefix(list(range(32)), MatchMode.RESUME).prefix_len == 20
    assert tree.match_prefix(list(range(32)), MatchMode.TRANSFER).prefix_len == 32
    check(tree)


def test_insert_dedups_and_frees_the_duplicate_pages() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=8)
    free_before = tree.full.num_free, tree.swa.num_free  # type: ignore[union-attr]
    kv = admit(tree, list(range(16)), swa_start=8)
    assert tree.insert(kv.token_ids, kv.full_page_ids, kv.swa_page_ids, 8) == 16
    assert (tree.full.num_free, tree.swa.num_free) == free_before  # type: ignore[union-attr]
    check(tree)


def test_insert_heals_a_tombstone_with_the_callers_live_swa() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=16)  # all tombstone
    assert tree.swa_stats().evictable == 0
    finish(tree, list(range(16)), swa_start=8)  # live SWA for pages 2, 3: heals them
    assert tree.swa_stats().evictable == 2
    assert tree.match_prefix(list(range(16)), MatchMode.RESUME).prefix_len == 16
    check(tree)


def test_insert_rejects_bad_pages_and_leaves_the_tree_unchanged() -> None:
    tree = make_tree()
    with pytest.raises(PageError):
        tree.insert(list(range(8)), [1, 2], [0, 0], 8)  # pages never allocated
    kv = admit(tree, list(range(8)), swa_start=0)
    hole = list(kv.swa_page_ids)
    hole[0] = 0
    with pytest.raises(PageError):
        tree.insert(kv.token_ids, kv.full_page_ids, hole, 0)  # a hole in the window
    assert tree.full_stats().evictable == 0
    check(tree, kv)


def test_cache_unfinished_repoints_pages_and_moves_the_lock() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=8)
    cached = tree.match_prefix(list(range(16)), MatchMode.TRANSFER).full_page_ids
    kv = admit(tree, [*range(16), 50, 51, 52, 53, 54, 55], swa_start=8)
    tree.cache_unfinished_req(kv)
    assert kv.full_page_ids[:4] == cached  # repointed onto the tree's pages
    assert kv.cache_protected_len == 20
    assert kv.lock is not None and kv.lock.node.full_lock == 1
    assert tree.full_stats().protected == 5
    check(tree, kv)
    tree.cache_finished_req(kv)
    assert tree.full_stats().protected == 0 and tree.full_stats().held_by_requests == 0
    check(tree)


def test_cache_finished_without_insert_frees_only_the_requests_own_pages() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=8)
    res = tree.match_prefix(list(range(24)), MatchMode.TRANSFER, max_len=16)
    kv = admit(tree, list(range(24)), swa_start=16)
    tree.full.free(kv.full_page_ids[:4])
    kv.full_page_ids[:4] = res.full_page_ids
    kv.cache_protected_len, kv.lock = 16, tree.lock(res.node)
    check(tree, kv)
    tree.cache_finished_req(kv, insert=False)  # a failed transfer
    assert tree.full_stats().evictable == 4 and tree.full_stats().held_by_requests == 0
    assert tree.swa_stats().held_by_requests == 0
    check(tree)


def test_evict_full_takes_least_recently_used_leaves_first() -> None:
    tree = make_tree()
    finish(tree, [1] * 8, swa_start=0)
    finish(tree, [2] * 8, swa_start=0)
    tree.match_prefix([1] * 8, MatchMode.TRANSFER)  # touch the first: the second is LRU
    freed = tree.evict_full(3)
    assert tree.match_prefix([2] * 8, MatchMode.TRANSFER).prefix_len == 0
    assert tree.match_prefix([1] * 8, MatchMode.TRANSFER).prefix_len == 4 and len(freed) == 3
    check(tree)


def test_evict_full_is_page_granular() -> None:
    """A leaf longer than the shortfall loses only its last pages; it stays the LRU leaf."""
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=0)
    swa_free = tree.swa.num_free  # type: ignore[union-attr]
    assert len(tree.evict_full(1)) == 1
    assert tree.match_prefix(list(range(16)), MatchMode.TRANSFER).prefix_len == 12
    assert tree.swa.num_free == swa_free + 1  # type: ignore[union-attr]  # its SWA page too
    check(tree)
    assert len(tree.evict_full(2)) == 2
    assert tree.match_prefix(list(range(16)), MatchMode.TRANSFER).prefix_len == 4
    check(tree)


def test_tree_without_swa_pool() -> None:
    tree = make_tree(swa=None)
    kv = admit(tree, list(range(18)), swa_start=0)
    tree.cache_unfinished_req(kv)
    assert tree.match_prefix(list(range(18)), MatchMode.RESUME).prefix_len == 16
    assert tree.swa_stats().total == 0 and tree.evict_swa(4) == []
    check(tree, kv)
    tree.cache_finished_req(kv)
    check(tree)


def test_check_integrity_catches_a_leak() -> None:
    tree = make_tree()
    tree.full.alloc(1)  # nobody declares it held
    with pytest.raises(Exception, match="total"):
        tree.check_integrity()


def test_page_keys_are_exact_per_page_and_drop_the_partial_page() -> None:
    from decode_worker.core.radix_node import page_keys

    keys = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(keys) == 2 and keys[0] != keys[1]
    assert keys == page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert page_keys([70000, 2, 3, 4], 4) != page_keys([70001, 2, 3, 4], 4)
    assert page_keys([5, 6, 7], 1) == [5, 6, 7]


def test_req_kv_keys_are_computed_once_and_extended_on_append() -> None:
    kv = ReqKV(list(range(9)), [], [])
    first = kv.keys(PS)
    assert len(first) == 2
    kv.token_ids += list(range(9, 16))
    again = kv.keys(PS)
    assert again is first and len(again) == 4  # same list, extended in place
    from decode_worker.core.radix_node import page_keys

    assert again == page_keys(kv.token_ids, PS)


def test_stats_always_sum_to_the_pool_size() -> None:
    tree = make_tree()
    kv = admit(tree, list(range(30)), swa_start=16)
    tree.cache_unfinished_req(kv)
    for stats in (tree.full_stats(), tree.swa_stats()):
        parts = stats.available + stats.evictable + stats.protected + stats.held_by_requests
        assert parts == stats.total
    assert tree.full_stats().held_by_requests == 1  # the partial last page
    check(tree, kv)


def test_insert_accepts_a_short_swa_list_when_no_swa_is_held() -> None:
    tree = make_tree()
    kv = admit(tree, list(range(16)), swa_start=16)
    kv.swa_page_ids = []  # nothing held: every inserted page is a tombstone
    tree.cache_finished_req(kv)
    assert tree.full_stats().evictable == 4 and tree.swa_stats().evictable == 0
    check(tree)
