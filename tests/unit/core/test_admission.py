"""Admission by the full and SWA page budgets: reuse cap, evictable capacity, reclaim, limits."""

from __future__ import annotations

import pytest

from decode_worker.core.admission import Abort, Admit
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.request import DecodeRequest, RequestState
from decode_worker.errors import ServiceUnavailable
from tests.unit.core.test_admission_helpers import Rig, admit_one, make_rig, req, run_to_finish

S = RequestState


def test_fresh_request_reserves_full_pages_and_the_swa_tail() -> None:
    rig = make_rig()
    d = admit_one(rig, req("a", 895))
    assert (d.prefix_len, d.swa_start) == (0, 704)
    assert len(d.full_page_ids) == 14 and len(d.swa_page_ids) == 3
    assert d.req.state is S.RESERVED
    rig.check([d.req])


def _finished_turn(rig: Rig, *, keep_swa: bool = True) -> DecodeRequest:
    """A 895-token request that ran two steps and finished (its KV cached); without
    `keep_swa`, the tree's SWA is evicted afterwards (full KV only, tombstones)."""
    first = req("a", 895)
    admit_one(rig, first)
    run_to_finish(rig, first, steps=2)
    if not keep_swa:
        assert rig.tree is not None and rig.swa is not None
        rig.tree.evict_swa(rig.swa.num_total)
    return first


def test_reused_prefix_goes_past_the_window_start() -> None:
    """Full KV is reused up to the last whole page (832 of 895), not capped at the window start
    (704); the tree still holds turn 1's live SWA of [704, 832), so only [832, 895) arrives, full
    and SWA (one page each)."""
    rig = make_rig()
    _finished_turn(rig)
    d = admit_one(rig, req("b", 895))
    assert d.prefix_len == 832 and d.swa_start == 832
    assert len(d.full_page_ids) == 1 and len(d.swa_page_ids) == 1
    assert rig.stats.prefix_hit_tokens_total == 832
    assert rig.tree is not None and rig.tree.full_stats().protected == 13  # locked prefix
    kv = d.req.kv
    assert kv is not None and kv.swa_start == 704 and kv.swa_owned_from is None
    assert all(kv.swa_page_ids[11:14]) and rig.tree.swa_stats().protected == 2
    assert rig.swa is not None
    rig.tree.evict_swa(rig.swa.num_total)  # the pages it reads stay: they are locked
    assert rig.swa.all_held(kv.swa_page_ids[11:13])
    rig.check([d.req])


def test_without_live_swa_the_tail_arrives_fresh_under_the_reused_prefix() -> None:
    """The same request once the tree's SWA is gone: full KV of [832, 895) and a fresh SWA tail
    of [704, 895), two ranges; the tail's pages under the prefix are the request's."""
    rig = make_rig()
    _finished_turn(rig, keep_swa=False)
    d = admit_one(rig, req("b", 895))
    assert (d.prefix_len, d.swa_start) == (832, 704)
    assert len(d.full_page_ids) == 1 and len(d.swa_page_ids) == 3
    assert d.req.kv is not None and d.req.kv.swa_owned_from == 704
    rig.check([d.req])


def test_a_tail_under_the_prefix_is_released_whole_on_abort_and_cached_on_finish() -> None:
    """The fresh SWA pages under the locked prefix are the request's: an abort before it runs
    frees them all; a run inserts them (healing the tree's tombstones) and the books balance."""
    rig = make_rig()
    _finished_turn(rig, keep_swa=False)
    aborted = admit_one(rig, req("b", 895))
    assert aborted.req.kv is not None and aborted.req.kv.swa_owned_from == 704
    assert rig.queue.abort_request("b", 1.0, "client_abort") is not None
    assert aborted.req.kv is None
    rig.check([])
    again = admit_one(rig, req("c", 895))
    run_to_finish(rig, again.req, steps=3)
    rig.check([])
    assert rig.tree.swa_stats().evictable >= 3  # the healed window is cached again


def test_admission_counts_evictable_capacity() -> None:
    rig = make_rig(full_pages=20, swa_pages=8, decode_reserve_tokens=64)
    a = req("a", 895, base=10_000)
    admit_one(rig, a)
    run_to_finish(rig, a)  # 896 tokens with KV: 14 pages cached, evictable
    assert rig.full.num_free == 6
    d = admit_one(rig, req("b", 895))  # 14 new pages + 1 reserve > 6 free: fits with evictable
    assert len(d.full_page_ids) == 14
    assert rig.stats.evicted_full_pages_total >= 14 - 6
    rig.check([d.req])


def test_request_that_does_not_fit_waits_and_blocks_the_line() -> None:
    rig = make_rig(full_pages=20, swa_pages=8)
    a = req("a", 895)
    admit_one(rig, a)
    assert rig.queue.enqueue(req("b", 895, base=1), 0.0) is None
    assert rig.queue.enqueue(req("c", 10, base=2), 0.0) is None
    assert rig.queue.pop_admitted(0.0) == []  # b waits; c waits behind it (FIFO)
    assert rig.tree is not None and rig.tree.full_stats().protected == 0  # no lock leaked
    run_to_finish(rig, a)
    got = rig.queue.pop_admitted(1.0)
    assert [d.req.rid for d in got] == ["b", "c"]
    rig.check([d.req for d in got])


def test_never_fitting_request_aborts_at_add() -> None:
    rig = make_rig(full_pages=10)
    r = req("a", 600, max_new=100)
    ab = rig.queue.enqueue(r, 0.0)
    assert isinstance(ab, Abort) and ab.reason == "too_large" and "full pages" in ab.message
    assert r.state is S.ABORTED and rig.queue.num_queued == 0
    assert rig.stats.aborts_total == {"too_large": 1}


def test_full_queue_raises_service_unavailable() -> None:
    rig = make_rig(max_queued=2)
    rig.queue.enqueue(req("a", 1), 0.0)
    rig.queue.enqueue(req("b", 1), 0.0)
    with pytest.raises(ServiceUnavailable):
        rig.queue.enqueue(req("c", 1), 0.0)
    assert rig.queue.num_queued == 2


def test_a_pass_queues_its_arrivals_first_and_aborts_those_that_cannot_wait() -> None:
    """The step's arrivals join before the pass (so it may admit them); past the bound one
    is aborted (`queue_full`), one that can never fit too (`too_large`), both counted by
    admission, and the pass goes on."""
    rig = make_rig(full_pages=10, max_queued=2, max_active=1)
    wait = req("w", 100)
    rig.queue.enqueue(wait, 0.0)
    new = [req("big", 600, max_new=100), req("a", 100, base=1), req("b", 100, base=2),
           req("c", 100, base=3)]
    got = rig.queue.pop_admitted(1.0, new)
    aborts = [(d.req.rid, d.reason) for d in got if isinstance(d, Abort)]
    assert aborts == [("big", "too_large"), ("b", "queue_full"), ("c", "queue_full")]
    assert [d.req.rid for d in got if isinstance(d, Admit)] == ["w"]  # first come, one slot
    assert new[2].state is S.ABORTED and new[1].state is S.QUEUED
    assert new[1].entered_at[S.QUEUED] == 1.0 and rig.queue.num_queued == 1
    assert rig.stats.aborts_total == {"too_large": 1, "queue_full": 2}


class _SpyTree(UnifiedRadixTree):
    """Records eviction asks; `swa_fail` makes the next `swa_fail` SWA evictions free nothing
    (a tree whose evictable count cannot be realised)."""

    swa_asks: list[int]
    swa_fail: int = 0

    def evict_swa(self, num_pages: int) -> list[int]:
        self.swa_asks = [*getattr(self, "swa_asks", []), num_pages]
        if self.swa_fail > 0:
            self.swa_fail -= 1
            return []
        return super().evict_swa(num_pages)


def _fill_swa_with_cached(rig_swa_free: int) -> tuple[Rig, list[DecodeRequest]]:
    rig = make_rig(full_pages=80, swa_pages=7, tree_cls=_SpyTree)
    done = []
    for i in range(2):  # each leaves 3 live SWA pages cached ([704, 896))
        r = req(f"old{i}", 895, base=1000 * (i + 1))
        admit_one(rig, r)
        run_to_finish(rig, r)
        done.append(r)
    assert rig.swa is not None and rig.swa.num_free == rig_swa_free
    return rig, done


def test_reclaim_rounds_to_pages() -> None:
    rig, _ = _fill_swa_with_cached(1)
    d = admit_one(rig, req("a", 895))  # tail 191 tokens -> 3 pages; 1 free -> evict exactly 2
    tree = rig.tree
    assert isinstance(tree, _SpyTree) and tree.swa_asks == [2]
    assert len(d.swa_page_ids) == 3
    rig.check([d.req])


def test_reclaim_failure_rejects_only_that_request_and_next_is_admitted() -> None:
    rig, _ = _fill_swa_with_cached(1)
    tree = rig.tree
    assert isinstance(tree, _SpyTree)
    tree.swa_fail = 1
    # matches old0's prefix up to the window start (so its whole SWA tail is new), then the
    # reclaim fails
    x = DecodeRequest("x", 1, list(range(1000, 1704)) + [9] * 191, 8)
    rig.queue.enqueue(x, 0.0)
    rig.queue.enqueue(req("y", 895), 0.0)
    got = rig.queue.pop_admitted(0.0)
    assert isinstance(got[0], Abort) and got[0].reason == "swa_reclaim_insufficient"
    assert got[0].message == "SWA eviction insufficient: needed=3, available=1, req=x"
    assert isinstance(got[1], Admit) and got[1].req.rid == "y"
    assert tree.full_stats().protected == 0  # x's prefix lock released
    rig.check([got[1].req])


def test_deadline_expiry_returns_pages() -> None:
    rig = make_rig(queue_timeout_s=5.0, kv_timeout_s=2.0, full_pages=20)
    d = admit_one(rig, req("a", 895), now=0.0)
    assert rig.queue.enqueue(req("b", 895, base=7), 0.0) is None  # waits: no room
    assert rig.queue.pop_admitted(0.0) == []
    assert rig.queue.expire(1.0) == []
    (ab,) = rig.queue.expire(2.5)
    assert ab.req is d.req and ab.reason == "kv_timeout" and d.req.kv is None
    assert rig.full.num_free == rig.full.num_total
    (ab2,) = rig.queue.expire(5.5)
    assert ab2.reason == "queue_timeout" and rig.queue.num_queued == 0
    assert rig.stats.aborts_total == {"kv_timeout": 1, "queue_timeout": 1}
    rig.check([])


def test_one_call_gives_the_pass_then_the_deadlines() -> None:
    """`pop_admitted(expire=True)`: the pass runs before the deadlines, so pages an expiry
    returns are admitted from by the next pass, not this one."""
    rig = make_rig(queue_timeout_s=5.0, kv_timeout_s=2.0, full_pages=20)
    d = admit_one(rig, req("a", 895), now=0.0)
    assert rig.queue.enqueue(req("b", 895, base=7), 0.0) is None  # waits: no room
    (ab,) = rig.queue.pop_admitted(2.5, expire=True)
    assert isinstance(ab, Abort) and ab.req is d.req and ab.reason == "kv_timeout"
    assert rig.queue.num_queued == 1  # b still waits though a's pages are free
    (b,) = rig.queue.pop_admitted(2.6)
    assert isinstance(b, Admit) and b.req.rid == "b"
    rig.check([b.req])


def test_client_abort_in_transfer_returns_pages() -> None:
    rig = make_rig()
    d = admit_one(rig, req("a", 500))
    ab = rig.queue.abort_request("a", 1.0, "client_abort")
    assert ab is not None and d.req.state is S.ABORTED
    assert rig.queue.abort_request("a", 2.0, "client_abort") is None
    rig.check([])


def test_without_radix_cache_start_is_seq_minus_window() -> None:
    rig = make_rig(radix=False)
    a = req("a", 895)
    admit_one(rig, a)
    run_to_finish(rig, a)
    d = admit_one(rig, req("b", 895))
    assert d.prefix_len == 0 and d.swa_start == 768 and len(d.swa_page_ids) == 2
    rig.check([d.req])


def test_model_without_swa_reuses_the_aligned_prompt() -> None:
    rig = make_rig(swa_pages=None)
    a = req("a", 895)
    admit_one(rig, a)
    run_to_finish(rig, a)
    d = admit_one(rig, req("b", 895))
    assert d.prefix_len == 832 and d.swa_page_ids == [] and len(d.full_page_ids) == 1
    rig.check([d.req])


def test_max_active_bounds_admissions() -> None:
    rig = make_rig(max_active=1)
    rig.queue.enqueue(req("a", 10), 0.0)
    rig.queue.enqueue(req("b", 10, base=5), 0.0)
    assert [d.req.rid for d in rig.queue.pop_admitted(0.0)] == ["a"]


def test_admission_keeps_room_for_running_requests_to_grow() -> None:
    rig = make_rig(full_pages=11, swa_pages=16, decode_reserve_tokens=4 * 64)
    a = req("a", 4 * 64, max_new=4 * 64 + 1)  # 4 pages + 4 reserved for growth
    admit_one(rig, a)
    assert rig.queue.enqueue(req("b", 4 * 64, base=9, max_new=1), 0.0) is None  # 4 pages, no growth
    assert rig.queue.pop_admitted(0.0) == []  # 7 free, 4 of them are a's growth room
    rig.queue.abort_request("a", 1.0, "client_abort")
    assert [d.req.rid for d in rig.queue.pop_admitted(1.0)] == ["b"]


def test_retracted_requests_are_readmitted_before_new_ones() -> None:
    rig = make_rig()
    a = req("a", 100)
    admit_one(rig, a)
    a.transition(RequestState.READY, 0.5, first_token=3)
    a.transition(RequestState.RUNNING, 0.5, keeper=rig.dec.ctx)
    rig.queue.enqueue(req("new", 50, base=7), 0.6)
    a.transition(RequestState.RETRACTED, 1.0, keeper=rig.ctx)
    rig.queue.requeue([a], 1.0)
    got = rig.queue.pop_admitted(1.0)
    assert [d.req.rid for d in got] == ["a", "new"]
    assert isinstance(got[0], Admit) and got[0].req.is_resumed
    rig.check([d.req for d in got])


def _next_turn(first: DecodeRequest, rid: str, new_tokens: int, *, sglang: int) -> DecodeRequest:
    prompt = first.prompt_ids + first.output_ids + [7_000 + i for i in range(new_tokens)]
    r = DecodeRequest(rid, 5, prompt, 8)
    r.sglang_page_size = sglang
    return r


def test_sglang_next_turn_asks_only_past_the_prefix_when_the_tree_holds_its_window() -> None:
    """A short new message: the tree holds live SWA for [L - 127, P), so the SGLang prefill is
    asked for full KV and SWA of [P, L) only (decode_prefix_len = P = 896, above L - 127)."""
    rig = make_rig()
    first = _finished_turn(rig)
    d = admit_one(rig, _next_turn(first, "b", 5, sglang=64))
    assert d.req.fill_len == 903 and d.prefix_len == 896  # every whole page of turn 1
    assert d.swa_start == 896  # SGLang's window start: max(P, L - 127) on its page
    assert len(d.full_page_ids) == 1 and len(d.swa_page_ids) == 1
    kv = d.req.kv
    assert kv is not None and kv.swa_start == 768 and all(kv.swa_page_ids[12:15])
    assert not set(kv.swa_page_ids[12:14]) & set(d.swa_page_ids)  # the tree's, locked
    rig.check([d.req])


def test_sglang_next_turn_without_live_swa_stops_at_the_window_start() -> None:
    """The same turn once the tree's SWA is gone: asking past L - 127 would leave SWA missing,
    so the reuse stops at the window's page (768) and the whole window arrives fresh."""
    rig = make_rig()
    first = _finished_turn(rig, keep_swa=False)
    d = admit_one(rig, _next_turn(first, "b", 5, sglang=64))
    assert (d.prefix_len, d.swa_start) == (768, 768)
    assert len(d.full_page_ids) == 3 and len(d.swa_page_ids) == 3
    rig.check([d.req])


def test_sglang_window_of_a_smaller_prefill_page_starts_inside_our_page() -> None:
    """Without the radix cache a prefill page of 16 under our 64: SGLang sends SWA from
    floor16(895 - 127) = 768 ... and from floor16(900 - 127) = 768 + 5 -> 768 for 900, 784 for
    911; our SWA pages start at the page holding it."""
    rig = make_rig(radix=False)
    r = DecodeRequest("c", 1, list(range(911)), 8)
    r.sglang_page_size = 16
    d = admit_one(rig, r)
    assert d.prefix_len == 0 and d.swa_start == 784
    assert len(d.swa_page_ids) == 3  # pages of [768, 911)
    rig.check([d.req])
