"""Unified radix tree locks: full lock to the root, SWA lock over one window with its boundary
mark, early SWA release, and eviction around locks (page size 4, window 7)."""

from __future__ import annotations

import pytest

from decode_worker.core.radix_tree import MatchMode
from decode_worker.errors import LockStateError
from tests.unit.core.radix_helpers import check, finish, make_tree


def test_eviction_never_returns_a_locked_page() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=8)
    finish(tree, [7, *range(15)], swa_start=8)
    res = tree.match_prefix(list(range(16)), MatchMode.TRANSFER)
    lock = tree.lock(res.node)
    freed = tree.evict_full(100)
    assert not set(freed) & set(res.full_page_ids) and len(freed) == 4
    swa_freed = tree.evict_swa(100)
    assert not set(swa_freed) & {p for p in res.swa_page_ids if p}
    check(tree)
    tree.unlock(lock)
    assert sorted(tree.evict_full(100)) == sorted(res.full_page_ids)
    assert tree.full.num_free == 64 and tree.swa.num_free == 32  # type: ignore[union-attr]
    check(tree)


def test_unlock_with_skip_swa_after_early_release_keeps_counts_balanced() -> None:
    tree = make_tree()
    finish(tree, list(range(32)), swa_start=8)  # 6 live pages: leaf capped to 2
    res = tree.match_prefix(list(range(32)), MatchMode.RESUME)
    lock = tree.lock(res.node)
    assert tree.swa_stats().protected == 2  # one window (7 tokens) = the 2-page leaf
    tree.release_swa_lock(lock)
    tree.release_swa_lock(lock)  # idempotent
    assert tree.swa_stats().protected == 0
    tree.unlock(lock, skip_swa=True)
    assert tree.full_stats().protected == 0 and tree.swa_stats().protected == 0
    with pytest.raises(LockStateError):
        tree.unlock(lock)
    check(tree)


def test_swa_boundary_mark_moves_up_when_the_locked_node_splits() -> None:
    tree = make_tree()
    finish(tree, list(range(8)), swa_start=0)  # one live 2-page node
    res = tree.match_prefix(list(range(8)), MatchMode.RESUME)
    lock = tree.lock(res.node)
    mark = res.node.swa_uuid
    assert mark and lock.swa_uuid == mark
    upper = tree.match_prefix(list(range(4)), MatchMode.TRANSFER).node  # splits the node
    assert upper.swa_uuid == mark and res.node.swa_uuid == 0
    assert upper.swa_lock == 1 and res.node.swa_lock == 1
    other = tree.lock(upper)  # a second lock sharing the upper node
    tree.unlock(lock)
    assert upper.swa_lock == 1 and res.node.swa_lock == 0
    tree.unlock(other)
    check(tree)


def test_a_tombstone_healed_after_a_lock_is_not_released_by_it() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=16)  # all tombstone
    res = tree.match_prefix(list(range(16)), MatchMode.TRANSFER)
    lock = tree.lock(res.node)  # locks full only: no live SWA on the path
    finish(tree, list(range(16)), swa_start=0)  # heals the whole path
    second = tree.lock(res.node)
    tree.unlock(lock)  # must not take the second lock's SWA refs
    assert res.node.swa_lock == 1
    tree.unlock(second)
    check(tree)


def test_match_with_zero_cap_returns_the_root_and_locking_it_is_a_no_op() -> None:
    tree = make_tree()
    finish(tree, list(range(16)), swa_start=8)
    res = tree.match_prefix(list(range(16)), MatchMode.TRANSFER, max_len=0)
    assert res.prefix_len == 0 and res.node is tree.root
    lock = tree.lock(res.node)
    assert tree.full_stats().protected == 0
    tree.unlock(lock)
    check(tree)


def test_locking_a_node_evicted_since_its_match_raises() -> None:
    tree = make_tree()
    finish(tree, list(range(8)), swa_start=0)
    res = tree.match_prefix(list(range(8)), MatchMode.TRANSFER)
    tree.evict_full(100)
    with pytest.raises(LockStateError):
        tree.lock(res.node)
    check(tree)
