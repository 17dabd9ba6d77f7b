"""Decode-step pages: growth at page boundaries, the sliding SWA window, retraction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.core.request import DecodeRequest, RequestState, StepCommit
from decode_worker.core.window import swa_peak_pages
from tests.examples import examples
from tests.unit.core.test_admission_helpers import PS, WIN, Rig, admit_one, make_rig, req

S = RequestState


def _running(rig: Rig, r: DecodeRequest, now: float = 0.0) -> DecodeRequest:
    admit_one(rig, r, now)
    r.transition(RequestState.READY, now, first_token=1)
    r.transition(RequestState.RUNNING, now, keeper=rig.dec.ctx)
    return r


def _step(rig: Rig, reqs: list[DecodeRequest], token: int = 5) -> list[DecodeRequest]:
    plan = rig.dec.prepare_step(reqs, 1.0)
    StepCommit(plan.runnable).commit([token] * len(plan.runnable))
    rig.queue.requeue(plan.retracted, 1.0)
    return plan.retracted


def test_new_page_only_at_a_page_boundary() -> None:
    rig = make_rig()
    r = _running(rig, req("a", 2 * PS - 1, max_new=200))
    assert r.kv is not None and len(r.kv.full_page_ids) == 2
    _step(rig, [r])  # writes position 127: still page 1
    assert len(r.kv.full_page_ids) == 2
    _step(rig, [r])  # position 128: page 2
    assert len(r.kv.full_page_ids) == 3
    rig.check([r])


def test_swa_window_slides_and_live_pages_stay_bounded() -> None:
    rig = make_rig(full_pages=64, swa_pages=16)
    r = _running(rig, req("a", 300, max_new=1200))
    peak = swa_peak_pages(WIN, PS, True)
    for _ in range(1000):
        _step(rig, [r])
        assert r.kv is not None
        live = [p for p in r.kv.swa_page_ids if p]
        assert len(live) <= peak
        rig.check([r])
    assert rig.stats.swa_pages_released_total > 0
    assert r.kv.lock is not None and not r.kv.lock.swa_held  # released early past the window


def test_retraction_frees_and_readmits() -> None:
    rig = make_rig(full_pages=12, swa_pages=16, decode_reserve_tokens=1)
    a = _running(rig, req("a", 5 * PS - 1, max_new=300))  # 5 pages
    b = _running(rig, req("b", 5 * PS - 1, base=10_000, max_new=300))
    _step(rig, [a, b])
    _step(rig, [a, b])  # both cross into page 6: 12 pages used, pool full
    for _ in range(PS - 1):
        _step(rig, [a, b])
    retracted = _step(rig, [a, b])  # both need a 7th page: one must go
    assert len(retracted) == 1
    victim = retracted[0]
    assert victim.state is S.QUEUED and victim.num_retractions == 1
    assert rig.stats.retractions_total == 1
    keeper = b if victim is a else a
    rig.check([keeper])
    # the keeper finishes, the victim is readmitted with its cached prefix and its outputs
    keeper.transition(RequestState.FINISHED, 2.0, keeper=rig.dec.ctx)
    (d,) = rig.queue.pop_admitted(3.0)
    assert d.req is victim and victim.is_resumed and d.prefix_len > 0
    assert victim.kv is not None and victim.kv.token_ids == victim.fill_ids
    victim.transition(RequestState.READY, 4.0, first_token=999)
    assert victim.output_ids[-1] != 999  # a resumed request replays its own last token
    victim.transition(RequestState.RUNNING, 4.0, keeper=rig.dec.ctx)
    _step(rig, [victim])
    rig.check([victim])


def test_lone_request_that_cannot_grow_is_retracted_not_deadlocked() -> None:
    rig = make_rig(full_pages=6, swa_pages=8, decode_reserve_tokens=1)
    a = _running(rig, req("a", 3 * PS, max_new=PS))  # 3 pages; position 192 needs a 4th
    held = rig.full.alloc(3)  # pages of requests still receiving KV (admission would not
    retracted = _step(rig, [a])  # let this happen; a readmission race could)
    assert retracted == [a] and a.state is S.QUEUED
    rig.full.free(held)
    (d,) = rig.queue.pop_admitted(2.0)
    assert d.req is a and d.prefix_len == 3 * PS  # every whole page; the SWA tail is fresh



def test_retraction_order_prefers_fewest_outputs_then_longest() -> None:
    from decode_worker.core.decode_alloc import _retract_order

    short = DecodeRequest("s", 1, [1] * 10, 5, output_ids=[1, 2, 3])
    young_long = DecodeRequest("y", 1, [1] * 100, 5, output_ids=[1])
    young_short = DecodeRequest("z", 1, [1] * 10, 5, output_ids=[1])
    order = sorted([short, young_long, young_short], key=_retract_order)
    assert [r.rid for r in order] == ["y", "z", "s"]


def test_without_radix_cache_swa_pages_are_freed_as_the_window_moves() -> None:
    rig = make_rig(radix=False)
    r = _running(rig, req("a", 300, max_new=600))
    for _ in range(500):
        _step(rig, [r])
    rig.check([r])
    assert rig.stats.swa_pages_released_total >= (800 - 300) // PS - 1
    r.transition(RequestState.FINISHED, 2.0, keeper=rig.dec.ctx)
    rig.check([])


@given(prompt=st.integers(1, 700), radix=st.booleans(), steps=st.integers(1, 400))
@settings(max_examples=examples(60), deadline=None)
def test_slide_due_at_is_exact_and_the_batch_pieces_match_prepare_step(
        prompt: int, radix: bool, steps: int) -> None:
    """Below `slide_due_at` a slide changes nothing; at it, it does. Sliding and growing only the
    request at an edge (`slide` + `grow`, the batch scheduler's way) leaves the same pages as
    `prepare_step` over it every step."""
    rigs = [make_rig(full_pages=64, swa_pages=16, radix=radix) for _ in range(2)]
    reqs = [_running(rig, req("a", prompt, max_new=steps + 2)) for rig in rigs]
    for _ in range(steps):
        a, b = reqs
        assert a.kv is not None and b.kv is not None
        due = rigs[0].dec.slide_due_at(a.kv)
        before = (a.kv.swa_start, list(a.kv.swa_page_ids), rigs[0].ctx.swa.num_free)  # type: ignore[union-attr]
        rigs[0].dec.slide([a])
        after = (a.kv.swa_start, list(a.kv.swa_page_ids), rigs[0].ctx.swa.num_free)  # type: ignore[union-attr]
        assert (before != after) == (a.kv.seq_len >= due), (a.kv.seq_len, due)
        assert rigs[0].dec.grow([a])
        rigs[1].dec.prepare_step([b], 1.0)
        assert (a.kv.full_page_ids, a.kv.swa_page_ids, a.kv.swa_start) == (
            b.kv.full_page_ids, b.kv.swa_page_ids, b.kv.swa_start)
        for rig, r in zip(rigs, reqs, strict=True):
            StepCommit([r]).commit([5])
            rig.check([r])
