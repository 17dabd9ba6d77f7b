"""Speculation's policy: drafts are verified only where they pay (a step's cost grows with its
entries), drafting backs off after misses, and a request's draft length grows while drafts
hold."""

from __future__ import annotations

from decode_worker.daemon.decode.speculate import Speculator, StepCost, TokenView
from tests.spec_rig import ScriptedDrafter

K = 8


def _spec(cost: StepCost | None) -> Speculator:
    spec = Speculator(ScriptedDrafter(lambda rid, toks, k: [7] * k), K, cost)
    for rid in ("good", "bad"):
        spec.joined(rid, [1, 2, 3], [4])
    return spec


def _drafts(spec: Speculator) -> list[list[int]] | None:
    views = [TokenView([1, 2, 3], [4]) for _ in range(2)]
    return spec.drafts(["good", "bad"], views, [K, K])


def test_only_the_requests_whose_drafts_pay_are_verified() -> None:
    # a fixed cost per step plus a cost per entry (a small CPU model)
    spec = _spec(StepCost([(1, 1.0), (64, 8.0)]))
    spec._states["good"].alpha, spec._states["bad"].alpha = 0.95, 0.05
    got = _drafts(spec)
    assert got is not None and got[0] and got[1] == []  # the good one's drafts only
    spec._states["good"].alpha = 0.2
    assert _drafts(spec) is None  # nobody's drafts earn their entries


def test_a_flat_cost_verifies_everyone_and_no_cost_model_always_does() -> None:
    flat = StepCost([(1, 1.0), (64, 1.05)])  # a GPU at small batch: entries are nearly free
    spec = _spec(flat)
    got = _drafts(spec)
    assert got is not None and all(len(d) == K for d in got)
    assert _drafts(_spec(None)) is not None


def test_misses_shorten_and_then_pause_drafting_and_hits_lengthen_it() -> None:
    spec = _spec(None)
    for _ in range(3):  # "bad" keeps none of its drafts
        spec.record(["good", "bad"], [[7] * 2, [7] * 4], [[7, 7, 9], [9]])
    st_good, st_bad = spec._states["good"], spec._states["bad"]
    assert st_good.k == K and st_good.alpha > 0.9  # grew back to K, kept everything
    assert st_bad.k == 1 and st_bad.paused_until > spec._step  # halved, then paused
    got = _drafts(spec)
    assert got is not None and got[1] == []


def test_steps_with_nothing_worth_verifying_back_off_to_plain_steps() -> None:
    spec = _spec(StepCost([(1, 1.0), (64, 64.0)]))  # nothing pays on a linear cost
    waits = []
    for _ in range(4):
        assert spec.may_draft() and _drafts(spec) is None
        quiet = 0
        while not spec.may_draft():
            quiet += 1
        waits.append(quiet)
    assert waits == [0, 1, 3, 7]  # 1, 2, 4, 8 steps without drafting (this one included)
