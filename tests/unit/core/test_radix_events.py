"""KV events of the radix tree: SGLang's page-chain hashes, what each tree operation records, and
what it must not (splits, tombstones)."""

from __future__ import annotations

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.page_chain import PageRun
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    chain_hashes,
)
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from tests.unit.core.radix_helpers import PS, WIN, admit, check


def events_tree(full: int = 64, swa: int | None = 32, ps: int = PS) -> UnifiedRadixTree:
    return UnifiedRadixTree(ps, WIN, PageAllocator(full, "full"),
                            PageAllocator(swa, "swa") if swa else None, kv_events=True)


def finish(tree: UnifiedRadixTree, tokens: list[int], swa_start: int = 0) -> None:
    tree.cache_finished_req(admit(tree, tokens, swa_start))
    check(tree)


def test_chain_hashes_match_sglang_test_vectors() -> None:
    # the vectors of sgl-router's hash.rs tests, recomputed from SGLang's recipe
    assert chain_hashes([1, 2, 3, 4], 4) == [-3488128144981237669]
    assert chain_hashes([1, 2, 3, 4, 5], 4) == [-3488128144981237669, -3787494577174227566]
    assert chain_hashes(list(range(10, 90, 10)), 2) == [
        978178666101069530, -895308556211281782, -8033692805846017938, 835415944263129316]


def test_insert_records_one_store_with_the_page_chain() -> None:
    tree = events_tree()
    toks = list(range(1, 14))  # 3 full pages and a partial one (never cached)
    finish(tree, toks)
    (ev,) = tree.take_events()
    assert ev == BlockStored(chain_hashes(toks[:12], PS), None, toks[:12], PS, "GPU", None)
    assert tree.take_events() == []


def test_shared_prefix_store_chains_from_the_parent_and_a_split_records_nothing() -> None:
    tree = events_tree()
    a, b = list(range(12)), [*list(range(8)), 50, 51, 52, 53]
    finish(tree, a)
    tree.take_events()
    tree.match_prefix(list(range(8)), MatchMode.TRANSFER)  # splits the node after 2 pages
    assert tree.take_events() == []
    finish(tree, b)
    (ev,) = tree.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash == chain_hashes(a[:8], PS)[-1]
    assert ev.block_hashes == chain_hashes(b, PS)[2:] and ev.token_ids == b[8:]


def test_page_granular_eviction_removes_only_the_trimmed_pages() -> None:
    tree = events_tree()
    toks = list(range(16))
    finish(tree, toks)
    tree.take_events()
    assert len(tree.evict_full(1)) == 1
    assert tree.take_events() == [BlockRemoved(chain_hashes(toks, PS)[3:], "GPU")]
    tree.evict_full(10)
    assert tree.take_events() == [BlockRemoved(chain_hashes(toks, PS)[:3], "GPU")]


def test_recording_hashes_nothing_and_late_reads_stay_exact() -> None:
    # the compute thread only names pages; a reader computes the values, even after the pages
    # left the tree and their nodes were split, trimmed or freed
    tree = events_tree()
    a, b = list(range(16)), [*list(range(8)), 70, 71, 72, 73]
    finish(tree, a)
    stored_a = tree.take_events()
    tree.match_prefix(list(range(8)), MatchMode.TRANSFER)  # split
    finish(tree, b)
    stored_b = tree.take_events()
    tree.evict_full(1)  # trims a's last page
    trimmed = tree.take_events()
    tree.flush()
    tree.take_events()
    finish(tree, [5] * 16)  # new pages, maybe in the same page ids
    assert all(run._digests is None for run in _runs(stored_a + stored_b + trimmed))
    assert stored_a == [BlockStored(chain_hashes(a, PS), None, a, PS, "GPU", None)]
    assert stored_b == [BlockStored(chain_hashes(b, PS)[2:], chain_hashes(a, PS)[1], b[8:], PS)]
    assert trimmed == [BlockRemoved(chain_hashes(a, PS)[3:], "GPU")]


def _runs(events: list[KVEvent]) -> list[PageRun]:
    return [run for e in events if not isinstance(e, AllBlocksCleared) for run, _, _ in e._pages]


def test_tombstone_keeps_the_full_kv_and_records_nothing() -> None:
    tree = events_tree()
    finish(tree, list(range(16)))
    tree.take_events()
    assert tree.evict_swa(100)
    assert tree.take_events() == []
    index = KVEventIndex()
    index.apply(tree.snapshot_events())
    assert index.match_len(list(range(16))) == 16 == tree.match_prefix(
        list(range(16)), MatchMode.TRANSFER).prefix_len


def test_flush_of_an_idle_tree_records_all_blocks_cleared() -> None:
    tree = events_tree()
    finish(tree, list(range(16)))
    tree.flush()
    assert tree.take_events() == [AllBlocksCleared()]
    assert not tree.root.children


def test_flush_with_a_locked_prefix_records_removals_only() -> None:
    tree = events_tree()
    finish(tree, list(range(16)))
    finish(tree, list(range(8)) + [99] * 8)
    tree.take_events()
    lock = tree.lock(tree.match_prefix(list(range(16)), MatchMode.TRANSFER).node)
    tree.flush()
    (ev,) = tree.take_events()
    assert ev == BlockRemoved(chain_hashes(list(range(8)) + [99] * 8, PS)[2:], "GPU")
    tree.unlock(lock)


def test_snapshot_rebuilds_the_same_index_as_the_log() -> None:
    tree = events_tree(full=12)
    live = KVEventIndex()
    for base in ([1] * 16, [1] * 8 + [2] * 8, [3] * 20, [1] * 4 + [4] * 12):
        short = max(0, 4 - tree.full.num_free)
        if short:
            tree.evict_full(short)
        finish(tree, base)
        live.apply(tree.take_events())
    snap = KVEventIndex()
    snap.apply(tree.snapshot_events())
    assert snap.entries() == live.entries() and live.orphan_stores == 0


def test_page_size_one_tokens_and_hashes() -> None:
    tree = events_tree(ps=1, swa=None)
    tree.insert([7, 8, 9], tree.full.alloc(3), [], 0)
    (ev,) = tree.take_events()
    assert ev == BlockStored(chain_hashes([7, 8, 9], 1), None, [7, 8, 9], 1, "GPU", None)


def test_a_tree_without_events_records_and_hashes_nothing() -> None:
    tree = UnifiedRadixTree(PS, WIN, PageAllocator(64, "full"), PageAllocator(32, "swa"))
    finish(tree, list(range(16)))
    tree.flush()
    assert tree.take_events() == [] and tree.snapshot_events() == []


def test_match_across_media_takes_device_pages_then_host_pages() -> None:
    toks = list(range(1, 17))  # 4 pages of 4
    hashes = chain_hashes(toks, 4)
    index = KVEventIndex()
    index.apply([BlockStored(hashes[:2], None, toks[:8], 4, "GPU", None),
                 BlockStored(hashes, None, toks, 4, "CPU_PINNED", None)])
    assert index.match_len(toks) == 8 and index.match_len(toks, "CPU_PINNED") == 16
    assert index.match_len_across(toks) == 16  # 2 device pages, then 2 host pages
    assert index.match_len_across(toks, ("CPU_PINNED", "GPU")) == 16
    index.apply([BlockRemoved(hashes[1:3], "CPU_PINNED")])
    assert index.match_len_across(toks) == 8  # page 2 is nowhere: the match ends there
    # the walk never goes back to an earlier medium: page 1 only on the device after a host page
    index.apply([BlockRemoved(hashes[:1], "GPU"), BlockStored(hashes[1:2], hashes[0], toks[4:8],
                                                             4, "GPU", None)])
    index.apply([BlockStored(hashes[:1], None, toks[:4], 4, "CPU_PINNED", None)])
    assert index.match_len_across(toks) == 4
    assert KVEventIndex().match_len_across(toks) == 0  # no store yet: no block size
