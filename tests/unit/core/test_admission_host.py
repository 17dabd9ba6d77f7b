"""Admission with the host tier: host hits are advertised only when locked, the restore's
device pages are counted in the full budget, and an abort before the restore returns them."""

from __future__ import annotations

from decode_worker.core.admission import Admit
from decode_worker.core.host_tier import WritePolicy
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from decode_worker.core.request import RequestState
from tests.unit.core.test_admission_helpers import Rig, admit_one, make_rig, req, run_to_finish


def _host_tree(page_size: int, window: int, full: PageAllocator,
               swa: PageAllocator | None) -> UnifiedRadixTree:
    return UnifiedRadixTree(page_size, window, full, swa, host=PageAllocator(64, "host"),
                            write_policy=WritePolicy.WRITE_THROUGH)


def _demoted_turn() -> tuple[Rig, int]:
    """A finished 895-token turn, written through to the host and evicted from the device."""
    rig = make_rig(tree_cls=_host_tree)  # type: ignore[arg-type]
    first = req("a", 895)
    admit_one(rig, first)
    run_to_finish(rig, first, steps=2)
    assert rig.tree is not None
    writes = rig.tree.take_host_writes()
    assert sum(len(w.host_page_ids) for w in writes) == 14  # the aligned 897 tokens
    rig.tree.evict_full(rig.full.num_total)
    return rig, rig.full.num_free


def test_host_hits_are_advertised_locked_and_restored_into_counted_pages() -> None:
    rig, free_before = _demoted_turn()
    d = admit_one(rig, req("b", 895))
    assert isinstance(d, Admit) and d.restore is not None
    assert d.prefix_len == 832  # every whole page, all of it from the host
    assert d.restore.num_pages == 13 and d.restore.device_page_ids == d.full_page_ids[:13]
    assert len(d.full_page_ids) == 14  # restore + transfer pages, all in the full budget
    assert rig.full.num_free == free_before - 14
    assert rig.stats.host_hit_tokens_total == 832
    tree = rig.tree
    assert tree is not None
    tree.evict_host(1000)
    assert tree.host_stats_pages().protected == 13  # the locked hits survive
    rig.check([d.req])


def test_abort_before_the_restore_returns_every_page_and_the_host_lock() -> None:
    rig, free_before = _demoted_turn()
    d = admit_one(rig, req("b", 895))
    ab = rig.queue.abort_request("b", 1.0, "abort")
    assert ab is not None and d.req.state is RequestState.ABORTED
    assert rig.full.num_free == free_before
    assert rig.tree is not None and rig.tree.host_stats_pages().protected == 0
    rig.check([])


def test_restored_pages_join_the_tree_when_the_request_runs() -> None:
    rig, _ = _demoted_turn()
    d = admit_one(rig, req("b", 895))
    run_to_finish(rig, d.req)
    assert rig.tree is not None
    m = rig.tree.match_prefix(list(range(895)), MatchMode.TRANSFER)
    assert m.prefix_len == 832 and m.host_len == 0
    assert m.full_page_ids == d.full_page_ids[:13]  # the restored pages joined the tree
    rig.check([])
