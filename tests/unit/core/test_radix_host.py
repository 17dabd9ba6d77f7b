"""The host tier of the unified radix tree, one behaviour per test (page size 4, window 7)."""

from __future__ import annotations

from decode_worker.core.host_tier import HostTransition, Transition, WritePolicy
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from tests.unit.core.radix_helpers import PS, WIN, admit, check


def host_tree(policy: WritePolicy = WritePolicy.WRITE_THROUGH, full: int = 16,
              host: int = 32) -> tuple[UnifiedRadixTree, list[HostTransition]]:
    tree = UnifiedRadixTree(PS, WIN, PageAllocator(full, "full"), PageAllocator(16, "swa"),
                            host=PageAllocator(host, "host"), write_policy=policy)
    seen: list[HostTransition] = []
    tree.host_listener = seen.append
    return tree, seen


def cache(tree: UnifiedRadixTree, tokens: list[int]) -> None:
    tree.cache_finished_req(admit(tree, tokens, swa_start=len(tokens) // PS * PS - 8))
    check(tree)


def kinds(seen: list[HostTransition]) -> list[Transition]:
    return [t.kind for t in seen]


def test_write_through_backs_up_on_insert_and_demotes_on_device_eviction() -> None:
    tree, seen = host_tree()
    cache(tree, list(range(16)))
    writes = tree.take_host_writes()
    assert len(writes) == 1 and len(writes[0].host_page_ids) == 4
    assert sorted(tree.evict_full(4)) == sorted(writes[0].device_page_ids)
    res = tree.match_prefix(list(range(16)), MatchMode.TRANSFER)
    assert (res.prefix_len, res.host_len) == (0, 16)
    assert res.host_page_ids == writes[0].host_page_ids
    assert set(kinds(seen)) == {Transition.WRITE, Transition.DEMOTE}
    assert tree.host_stats_pages().evictable == 4
    check(tree)


def test_without_a_host_copy_device_eviction_deletes() -> None:
    tree, seen = host_tree(WritePolicy.WRITE_THROUGH_SELECTIVE)
    cache(tree, list(range(16)))
    assert tree.take_host_writes() == []  # selective: not on the first insert
    tree.evict_full(4)
    assert tree.match_prefix(list(range(16)), MatchMode.TRANSFER).total_len == 0
    assert seen == []
    check(tree)


def test_selective_writes_on_the_second_use() -> None:
    tree, _ = host_tree(WritePolicy.WRITE_THROUGH_SELECTIVE)
    cache(tree, list(range(16)))
    tree.match_prefix(list(range(16)), MatchMode.TRANSFER)
    assert sum(len(w.host_page_ids) for w in tree.take_host_writes()) == 4
    check(tree)


def test_write_back_copies_only_at_device_eviction() -> None:
    tree, seen = host_tree(WritePolicy.WRITE_BACK)
    cache(tree, list(range(16)))
    tree.match_prefix(list(range(16)), MatchMode.TRANSFER)
    assert tree.take_host_writes() == []
    freed = tree.evict_full(4)
    writes = tree.take_host_writes()
    assert sorted(writes[0].device_page_ids) == sorted(freed)  # copied before the pages are reused
    assert set(kinds(seen)) == {Transition.WRITE, Transition.DEMOTE}
    check(tree)


def test_host_hit_locked_restored_and_promoted_by_the_insert() -> None:
    tree, seen = host_tree()
    toks = list(range(24))
    cache(tree, toks)
    tree.take_host_writes()
    tree.evict_full(100)
    res = tree.match_prefix(toks, MatchMode.TRANSFER, max_len=16)
    assert (res.prefix_len, res.host_len) == (0, 16) and res.host_node is not None
    lock = tree.lock(res.host_node, swa=False)
    assert len(tree.evict_host(100)) == 2  # the unlocked tail past the match only
    assert tree.host_stats_pages().protected == 4
    full = tree.full.alloc(6)  # 4 restore pages + 2 transferred
    kv = ReqKV(toks, full, [0] * 4 + tree.swa.alloc(2), 16)  # type: ignore[union-attr]
    kv.lock = lock
    check(tree, kv)
    tree.cache_unfinished_req(kv)
    assert kv.full_page_ids[:4] == full[:4]  # the restored pages joined the tree
    assert Transition.PROMOTE in kinds(seen)
    res = tree.match_prefix(toks, MatchMode.TRANSFER)
    assert (res.prefix_len, res.host_len) == (24, 0)
    tree.cache_finished_req(kv)
    check(tree)


def test_host_eviction_is_lru_over_unlocked_host_only_leaves() -> None:
    tree, _ = host_tree(host=8)
    cache(tree, [1] * 16)
    cache(tree, [2] * 16)
    tree.evict_full(100)
    tree.match_prefix([1] * 16, MatchMode.TRANSFER)  # [1]* is now the most recent
    cache(tree, [3] * 16)  # its write needs room: the LRU host leaf goes
    assert tree.match_prefix([2] * 16, MatchMode.TRANSFER).total_len == 0
    assert tree.match_prefix([1] * 16, MatchMode.TRANSFER).host_len == 16
    check(tree)


def test_a_full_host_pool_skips_the_backup_and_counts_it() -> None:
    tree, _ = host_tree(host=2)
    cache(tree, list(range(16)))
    assert tree.take_host_writes() == [] and tree.host_stats.write_failures_total == 1
    check(tree)


def test_resume_matches_ignore_host_hits() -> None:
    tree, _ = host_tree()
    cache(tree, list(range(16)))
    tree.evict_full(100)
    assert tree.match_prefix(list(range(16)), MatchMode.RESUME).total_len == 0
    check(tree)
