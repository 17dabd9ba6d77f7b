"""Page keys built once per request and the O(1) blocked head: the key cache stays equal to a
fresh build as a request grows, and a waiting head is re-matched only when the tree or the pools
changed."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from decode_worker.core.radix_node import PageKey, page_keys
from decode_worker.core.radix_tree import MatchMode, MatchResult, UnifiedRadixTree
from decode_worker.core.request import DecodeRequest
from tests.unit.core.test_admission_helpers import Rig, admit_one, make_rig, req, run_to_finish


@given(
    prompt_len=st.integers(0, 300),
    grow=st.lists(st.integers(1, 70), max_size=8),
    page_size=st.sampled_from([1, 2, 16, 64]),
)
def test_cached_keys_equal_a_fresh_build_after_growth(
    prompt_len: int, grow: list[int], page_size: int
) -> None:
    r = DecodeRequest("r", 1, [(7 * i) % 70_000 for i in range(prompt_len)], 10_000)
    keys = r.page_keys(page_size)
    assert keys == page_keys(r.fill_ids, page_size)
    for n in grow:
        before = list(keys)
        r.output_ids += [(13 * (len(r.output_ids) + i)) % 70_000 for i in range(n)]
        again = r.page_keys(page_size)
        assert again is keys  # one list, extended in place
        assert again == page_keys(r.fill_ids, page_size)
        assert all(a is b for a, b in zip(again, before, strict=False))  # old keys not rebuilt


def test_cached_keys_follow_a_change_of_page_size() -> None:
    r = req("r", 200)
    assert len(r.page_keys(64)) == 3
    assert r.page_keys(16) == page_keys(r.fill_ids, 16)


class CountingTree(UnifiedRadixTree):
    """The real tree, counting its matches."""

    matches = 0

    def match_prefix(
        self,
        token_ids: Sequence[int],
        mode: MatchMode,
        max_len: int | None = None,
        *,
        keys: Sequence[PageKey] | None = None,
    ) -> MatchResult:
        CountingTree.matches += 1
        return super().match_prefix(token_ids, mode, max_len, keys=keys)


def _blocked_rig() -> tuple[Rig, DecodeRequest, DecodeRequest]:
    """`a` holds most of the full pool (RESERVED); `b` (another prefix) waits at the head."""
    CountingTree.matches = 0
    rig = make_rig(full_pages=20, swa_pages=8, tree_cls=CountingTree)
    a = req("a", 895)
    admit_one(rig, a)
    b = req("b", 895, base=100_000)
    assert rig.queue.enqueue(b, 0.0) is None
    assert rig.queue.pop_admitted(0.0) == []
    return rig, a, b


def test_a_blocked_head_is_not_rematched_while_nothing_changed() -> None:
    rig, a, _ = _blocked_rig()
    seen = CountingTree.matches
    for _ in range(5):
        assert rig.queue.pop_admitted(0.0) == []
    assert CountingTree.matches == seen
    assert rig.tree is not None and rig.tree.full_stats().protected == 0  # no lock leaked
    rig.check([a])


def test_a_blocked_head_is_rematched_after_an_insert_and_admitted() -> None:
    rig, a, b = _blocked_rig()
    seen = CountingTree.matches
    run_to_finish(rig, a)  # inserts a's KV and frees its lock: the tree and the pools changed
    (d,) = rig.queue.pop_admitted(1.0)
    assert d.req is b and CountingTree.matches == seen + 1
    rig.check([b])


def test_a_blocked_head_is_rematched_after_an_eviction() -> None:
    rig = make_rig(full_pages=20, swa_pages=8, tree_cls=CountingTree)
    cached = req("c", 400, base=50_000)
    admit_one(rig, cached)
    run_to_finish(rig, cached)  # 6 pages cached, evictable
    a = req("a", 640, base=70_000)
    admit_one(rig, a)  # a's 10 pages: 4 free pages left, 6 evictable
    b = req("b", 895, base=100_000)
    assert rig.queue.enqueue(b, 0.0) is None
    assert rig.queue.pop_admitted(0.0) == []
    seen = CountingTree.matches
    assert rig.queue.pop_admitted(0.0) == []
    assert CountingTree.matches == seen
    assert rig.tree is not None and rig.tree.evict_full(1)
    assert rig.queue.pop_admitted(0.0) == []  # still too big, but looked at again
    assert CountingTree.matches == seen + 1
    rig.check([a])


def test_a_blocked_head_is_rematched_after_the_pools_changed() -> None:
    rig, a, _ = _blocked_rig()
    seen = CountingTree.matches
    page = rig.full.alloc(1)  # a running request grew by a page
    assert rig.queue.pop_admitted(0.0) == []
    assert CountingTree.matches == seen + 1
    rig.full.free(page)
    rig.check([a])


def test_the_tree_version_moves_on_changes_not_on_matches() -> None:
    rig = make_rig(full_pages=40, swa_pages=16)
    tree = rig.tree
    assert tree is not None
    first = req("a", 895)
    admit_one(rig, first)
    run_to_finish(rig, first)
    v = tree.version
    m = tree.match_prefix(first.prompt_ids, MatchMode.TRANSFER, 500)  # splits a node
    assert m.prefix_len == 448 and tree.version == v
    lock = tree.lock(m.node)
    assert tree.version > v
    v = tree.version
    tree.unlock(lock)
    assert tree.version > v
    v = tree.version
    tree.evict_swa(1)
    assert tree.version > v
