"""Speculation's policy: drafts are verified only where they pay (a step's cost grows with its
entries), drafting backs off after misses, and a request's draft length grows while drafts
hold."""

from __future__ import annotations

from decode_worker.daemon.decode.speculate import Speculator, StepCost, TokenView
from tests.spec_rig import ScriptedDrafter

K = 8


def _spec(cost: StepCost | None) -> Speculator:
    """Two requests, "good" and "bad"."""
    spec = Speculator(ScriptedDrafter(lambda rid, toks, k: [7] * k), K, cost)
    for rid in ("good", "bad"):
        spec.joined(rid, [1, 2, 3], [4])
    return spec


def _measured(spec: Speculator, rid: str, alpha: float) -> None:
    """`rid`'s acceptance measured at `alpha` over many draft tokens."""
    st = spec._states[rid]
    st.kept_w, st.tried_w, st.fresh = 1000 * alpha, 1000.0, False


def _drafts(spec: Speculator) -> list[list[int]] | None:
    views = [TokenView([1, 2, 3], [4]) for _ in range(2)]
    return spec.drafts(["good", "bad"], views, [K, K])


def test_only_the_requests_whose_drafts_pay_are_verified() -> None:
    # a fixed cost per step plus a cost per entry (a small CPU model)
    spec = _spec(StepCost([(1, 1.0), (64, 8.0)]))
    _measured(spec, "good", 0.95)
    _measured(spec, "bad", 0.05)
    got = _drafts(spec)
    assert got is not None and got[0] and got[1] == []  # the good one's drafts only
    _measured(spec, "good", 0.2)
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
    assert st_good.k == K and st_good.alpha > 0.85  # grew back to K, kept everything (6 of 6)
    assert st_bad.k == 1 and st_bad.paused_until > spec._step  # halved, then paused
    got = _drafts(spec)
    assert got is not None and got[1] == []


def test_steps_with_nothing_worth_verifying_back_off_to_plain_steps() -> None:
    spec = _spec(StepCost([(1, 1.0), (64, 64.0)]))  # nothing pays on a linear cost
    for rid in ("good", "bad"):
        _measured(spec, rid, 0.5)
    waits = []
    for _ in range(4):
        assert spec.may_draft() and _drafts(spec) is None
        quiet = 0
        while not spec.may_draft():
            quiet += 1
        waits.append(quiet)
    assert waits == [0, 1, 3, 7]  # 1, 2, 4, 8 steps without drafting (this one included)


def test_a_declined_draft_is_measured_against_the_tokens_that_came() -> None:
    """Drafts the policy declines still count: each is checked against the tokens the request
    then produced (a plain step's), so a request that starts repeating itself is verified
    once its estimate says it pays, and one whose drafts fail stays unverified, without a
    verify step spent on either."""
    cost = StepCost([(1, 1.0), (64, 8.0)])
    spec = Speculator(ScriptedDrafter(lambda rid, toks, k: [7] * k), K, cost)
    spec.joined("copy", [1, 2, 3], [4])
    spec.joined("noise", [1, 2, 3], [4])
    out = {"copy": [4], "noise": [4]}
    verified_at = None
    for step in range(12):
        if not spec.may_draft():
            got = None
        else:
            got = spec.drafts(["copy", "noise"], [TokenView([1, 2, 3], out["copy"]),
                                                  TokenView([1, 2, 3], out["noise"])], [K, K])
        if got is not None:
            assert got[1] == []  # the noisy one is never worth a verify
            if got[0] and verified_at is None:
                verified_at = step
        out["copy"].append(7)  # a plain step: "copy" says what its drafts said, "noise" not
        out["noise"].append(9)
    assert verified_at is not None and verified_at > 0  # declined first (the prior), then paid
    copy, noise = spec._states["copy"], spec._states["noise"]
    assert copy.alpha > 0.7 and noise.alpha < 0.2
    assert spec.stats.verify_steps_total == 0  # measured without a verify (none was recorded)


def test_an_estimate_counts_tries_up_to_the_first_refusal() -> None:
    """Per-token acceptance given the tokens before were kept: a draft of 8 that keeps 3 is
    3 kept of 4 tried (the 4 after the refusal were never tried)."""
    spec = _spec(None)
    st = spec._states["good"]
    assert st.measure([7] * 8, [7, 7, 7, 9]) == 3
    assert (st.kept_w, st.tried_w) == (3, 4)
    assert st.measure([7] * 8, [7, 7]) == 2  # only two tokens known yet: two tried, both kept
    assert (round(st.kept_w, 6), round(st.tried_w, 6)) == (round(0.7 * 3 + 2, 6),
                                                           round(0.7 * 4 + 2, 6))


def test_a_request_that_joins_drafts_alone_in_the_quiet_steps() -> None:
    """After many steps with nothing worth verifying the policy drafts rarely; a request that
    joins may repeat what the worker has seen, so it drafts at once, alone (the others stay
    quiet: a stream of arrivals must not make the whole batch draft every step)."""
    spec = _spec(StepCost([(1, 1.0), (64, 1.05)]))  # verifying is nearly free
    for rid in ("good", "bad"):
        _measured(spec, rid, 0.0)  # nothing they draft is kept
    for _ in range(200):
        if spec.may_draft():
            assert _drafts(spec) is None
    assert spec._quiet_until > spec._step + 1  # quiet for a while
    spec.joined("new", [1, 2, 3], [4])
    assert spec.may_draft()
    views = [TokenView([1, 2, 3], [4]) for _ in range(3)]
    got = spec.drafts(["good", "bad", "new"], views, [K, K, K])
    assert got is not None and got[:2] == [[], []] and len(got[2]) == K  # the newcomer alone


def test_pauses_end_even_when_every_request_is_paused() -> None:
    """A pause is counted in steps: plain steps count while every request is paused (else no
    request would ever draft again)."""
    spec = _spec(None)
    for _ in range(3):  # both keep none of their drafts: paused
        spec.record(["good", "bad"], [[7] * 2, [7] * 2], [[9], [9]])
    assert all(st.paused_until > spec._step for st in spec._states.values())
    assert not spec.may_draft()
    assert any(spec.may_draft() for _ in range(2 * 64))  # the pause ran out


def test_a_slow_start_up_measurement_cannot_price_verifies_out() -> None:
    """Start-up timings are only ever too slow: a count slower than a larger one is noise, and a
    verify step of E entries costs at most a plain step of E entries (else a verify table
    measured under someone else's load would keep speculation off for good: no verify would
    run to correct it)."""
    cost = StepCost([(1, 1.0), (2, 5.0), (4, 1.2), (64, 8.0)],
                    verify=[(1, 1.0), (4, 1.1), (64, 80.0)])
    assert cost(2) == 1.2 and cost(64) == 8.0
    assert cost.verify(64) == 8.0 and cost.verify(4) == 1.1
    spec = Speculator(ScriptedDrafter(lambda rid, toks, k: [7] * k), K, cost)
    spec.joined("good", [1, 2, 3], [4])
    _measured(spec, "good", 0.95)
    got = spec.drafts(["good"], [TokenView([1, 2, 3], [4])], [K])
    assert got is not None and len(got[0]) == K  # verified, as the true costs say it pays
