"""Drafters against brute-force references (every occurrence, no index, no budget), and the
contract the verify side relies on (propose / accept / finish / flush)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.core.spec import SpecParams, make_drafter
from decode_worker.core.spec.ngram import NgramDrafter
from decode_worker.core.spec.suffix import SuffixDrafter
from decode_worker.errors import InvalidTransition
from tests.examples import examples
from tests.unit.core import spec_reference as ref

UNBOUNDED = 1 << 20  # search budgets large enough that nothing is cut
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=40)
history_st = st.lists(st.tuples(tokens_st, st.lists(st.integers(0, 3), max_size=20)),
                      max_size=4)


def _fill(drafter: NgramDrafter | SuffixDrafter,
          history: list[tuple[list[int], list[int]]]) -> None:
    """Finish earlier requests (prompt, output) into the shared memory."""
    for i, (prompt, output) in enumerate(history):
        drafter.start(f"old{i}", prompt)
        drafter.accept(f"old{i}", output)
        drafter.finish(f"old{i}")
        drafter.flush()


# live requests: (prompt, output, whether the prompt starts with r's prompt, flush after it)
live_st = st.lists(st.tuples(tokens_st, st.lists(st.integers(0, 3), max_size=20), st.booleans(),
                             st.booleans()), max_size=3)


def _run_live(drafter: NgramDrafter, prompt: list[int],
              live: list[tuple[list[int], list[int], bool, bool]], end: int) -> None:
    """Start the live requests (some repeating `prompt`, as n > 1 samples or a repeated tool
    call), then finish the last `end` of them without a flush (ignored from then on)."""
    for i, (other, output, repeat, flush) in enumerate(live):
        drafter.start(f"live{i}", (prompt if repeat else []) + other)
        drafter.accept(f"live{i}", output)
        if flush:
            drafter.flush()
    for i in range(len(live) - end, len(live)):
        drafter.finish(f"live{i}", keep=i % 2 == 0)


@settings(max_examples=examples(400), deadline=None)
@given(history=history_st, live=live_st, end=st.integers(0, 1), prompt=tokens_st,
       k=st.integers(1, 8), lo=st.integers(1, 3), span=st.integers(0, 6),
       capacity=st.integers(1, 120), flush=st.booleans(), output=st.lists(st.integers(0, 3),
                                                                          max_size=8))
def test_ngram_equals_longest_suffix_match(history: list[tuple[list[int], list[int]]],
                                           live: list[tuple[list[int], list[int], bool, bool]],
                                           end: int, prompt: list[int], k: int, lo: int,
                                           span: int, capacity: int, flush: bool,
                                           output: list[int]) -> None:
    drafter = NgramDrafter(SpecParams(
        "NGRAM", num_draft_tokens=k, ngram_min_match_window_size=lo,
        ngram_max_match_window_size=lo + span, ngram_capacity=capacity,
        max_chain=UNBOUNDED, short_chain=UNBOUNDED))
    _fill(drafter, history)
    _run_live(drafter, prompt, live, min(end, len(live)))
    drafter.start("r", prompt)
    drafter.accept("r", output)
    if flush:
        drafter.flush()
    shared = ref.live_sequences(drafter.shared)
    others = ref.live_others(drafter, "r")
    expected = ref.ngram(prompt + output, shared, k, lo, lo + span, others, drafter.live.n)
    assert drafter.propose(["r"], [k]) == [expected]
    drafter.check_integrity()


@settings(max_examples=examples(300), deadline=None)
@given(history=history_st, prompt=tokens_st, k=st.integers(1, 8), depth=st.integers(2, 12),
       factor=st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_prob=st.sampled_from([0.0, 0.1, 0.5]),
       cached=st.integers(-1, 3), flush=st.booleans())
def test_suffix_equals_arctic_speculate(history: list[tuple[list[int], list[int]]],
                                        prompt: list[int], k: int, depth: int, factor: float,
                                        min_prob: float, cached: int, flush: bool) -> None:
    drafter = SuffixDrafter(SpecParams(
        "SUFFIX", num_draft_tokens=k, suffix_max_tree_depth=depth,
        suffix_max_spec_factor=factor, suffix_min_token_prob=min_prob,
        suffix_max_cached_requests=cached, max_chain=UNBOUNDED, short_chain=UNBOUNDED))
    _fill(drafter, history)
    drafter.start("r", prompt)
    if flush:
        drafter.flush()
    shared = ref.live_sequences(drafter.shared)
    assert len(shared) <= (len(history) if cached < 0 else cached)
    expected = ref.suffix(prompt, shared, k, depth, factor, min_prob)
    assert drafter.propose(["r"], [k]) == [expected]


def test_suffix_drafts_grow_with_the_match() -> None:
    """A draft is at most max_spec_factor x the match length: one matched token, one
    drafted; a longer match, more."""
    drafter = make_drafter(SpecParams("SUFFIX", num_draft_tokens=8))
    drafter.start("r", [7, 1, 2, 3, 4, 5, 6, 9, 9])
    drafter.accept("r", [7])
    assert drafter.propose(["r"], [8]) == [[1]]  # "7" matched: one token
    drafter.accept("r", [1, 2, 3])
    assert drafter.propose(["r"], [8]) == [[4, 5, 6, 9]]  # "7 1 2 3": four


def test_suffix_min_token_prob_stops_at_a_split() -> None:
    """"5 1 2" came before 3 once and before 4 once: each has probability 1/2 (of equals, the
    newest wins)."""
    prompt = [5, 1, 2, 3, 5, 1, 2, 4, 5, 1, 2]
    for min_prob, expected in ((0.6, []), (0.5, [4, 5])):
        drafter = make_drafter(SpecParams("SUFFIX", num_draft_tokens=2,
                                          suffix_min_token_prob=min_prob))
        drafter.start("r", prompt)
        assert drafter.propose(["r"], [2]) == [expected]


def test_a_finished_answer_drafts_the_next_request_that_repeats_it() -> None:
    for algorithm in ("NGRAM", "SUFFIX"):
        drafter = make_drafter(SpecParams(algorithm, num_draft_tokens=4))  # type: ignore[arg-type]
        drafter.start("a", [50, 51, 52])
        drafter.accept("a", [60, 61, 62, 63, 64, 65])
        drafter.finish("a")
        drafter.flush()
        drafter.start("b", [70, 50, 51, 52])  # another agent, the same question
        drafter.accept("b", [60, 61, 62])
        assert drafter.propose(["b"], [4]) == [[63, 64, 65]], algorithm


def test_live_requests_draft_from_each_other() -> None:
    """Two samples of one prompt: the one ahead drafts the other (NGRAM), once a flush has
    shown its tokens; the cursor follows it as it goes on, and its finish ends that."""
    drafter = NgramDrafter(SpecParams("NGRAM", num_draft_tokens=8))
    prompt = [9, 8, 7, 6, 5]
    drafter.start("a", prompt)
    drafter.accept("a", [40, 41, 42, 43, 44, 45])
    drafter.start("b", prompt)
    assert drafter.propose(["b"], [4]) == [[]]  # a's tokens not shown yet
    drafter.flush()
    assert drafter.propose(["b", "a"], [4, 4]) == [[40, 41, 42, 43], []]
    drafter.accept("b", [40, 41])
    drafter.accept("a", [46, 47])  # a goes on: b's cursor reads on into it
    assert drafter.propose(["b"], [8]) == [[42, 43, 44, 45, 46, 47]]
    drafter.finish("a", keep=False)  # failed: not drafted from, not stored
    assert drafter.propose(["b"], [4]) == [[]]
    drafter.flush()
    assert drafter.propose(["b"], [4]) == [[]]
    assert set(map(id, drafter.live.holders.values())) == {id(drafter._reqs["b"])}
    drafter.check_integrity()


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
@pytest.mark.parametrize("every", [1, 64])
def test_a_batch_that_accepts_together_is_indexed_over_several_flushes(algorithm: str,
                                                                        every: int) -> None:
    """64 requests accept together, a token a step (`every` 1) or 64 at once every 64 steps
    (the policy's quiet steps hand tokens over only when it drafts): no flush indexes more
    than a quarter of them (before: all 64, 4096 tokens in one flush on the critical path of a
    short forward), and no request is left with more than two flushes' worth waiting."""
    from decode_worker.core.spec.base import FLUSH_BATCH, FLUSH_SPREAD

    drafter = make_drafter(SpecParams(algorithm, num_draft_tokens=4))  # type: ignore[arg-type]
    rids = [f"r{i}" for i in range(64)]
    for i, rid in enumerate(rids):
        drafter.start(rid, [i % 7, 100 + i] * 40)  # 80-token prompts
    reqs = [drafter._reqs[rid] for rid in rids]  # type: ignore[attr-defined]
    per_flush = []
    for step in range(1, 6 * FLUSH_BATCH + 1):
        if step % every == 0:
            for rid in rids:
                drafter.accept(rid, [(step + j) % 5 for j in range(every)])
        before = [r.own.indexed for r in reqs]
        drafter.flush()
        per_flush.append(sum(r.own.indexed != b for r, b in zip(reqs, before, strict=True)))
    drafter.check_integrity()
    assert max(per_flush) <= len(rids) // FLUSH_SPREAD, per_flush
    assert sum(per_flush) >= 5 * len(rids)  # each indexed about every FLUSH_BATCH tokens
    assert max(r.own.pending for r in reqs) < 2 * FLUSH_BATCH + every


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
def test_contract_errors_and_reused_rids(algorithm: str) -> None:
    drafter = make_drafter(SpecParams(algorithm, num_draft_tokens=4))  # type: ignore[arg-type]
    drafter.start("r", [1, 2, 3, 1, 2])
    with pytest.raises(InvalidTransition):
        drafter.start("r", [1])
    with pytest.raises(InvalidTransition):
        drafter.propose(["nobody"], [4])
    with pytest.raises(InvalidTransition):
        drafter.accept("nobody", [1])
    assert drafter.propose(["r", "r"], [0, -1]) == [[], []]
    first = drafter.propose(["r"], [4])
    assert first == drafter.propose(["r"], [4])  # proposing changes nothing
    # NGRAM: "1 2" then its own period on; SUFFIX: at most 2 x "1 2"
    assert first == [{"NGRAM": [3, 1, 2, 3], "SUFFIX": [3, 1]}[algorithm]]
    drafter.finish("r")
    drafter.finish("r")  # twice: harmless
    drafter.finish("nobody", keep=False)
    drafter.start("r", [9])  # a finished rid starts afresh
    assert drafter.stats().active_requests == 1
    drafter.flush()
    drafter.check_integrity()
