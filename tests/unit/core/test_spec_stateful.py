"""Hypothesis state machine over a drafter: random starts (rids reused), verify steps that
accept part of a draft plus a bonus token (or tokens no draft predicted), finishes with and
without storing, flushes, under small memory bounds. After every step the structures check
out (NGRAM's live index included); every draft is no longer than asked and follows, in a
memory it may come from (NGRAM: the other live requests too), a match of the request's latest
tokens; right after a flush, NGRAM's draft is the reference's over every memory; the shared
memory stays within its bounds."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from decode_worker.core.spec import SpecParams, make_drafter
from decode_worker.core.spec.arena import TokenArena
from decode_worker.core.spec.drafter import Drafter
from decode_worker.core.spec.ngram import NgramDrafter
from tests.examples import examples
from tests.unit.core import spec_reference as ref

RIDS = ["a", "b", "c", "d"]
small_tokens = st.lists(st.integers(0, 4), min_size=1, max_size=24)


class DrafterMachine(RuleBasedStateMachine):
    @initialize(algorithm=st.sampled_from(["NGRAM", "SUFFIX"]), k=st.integers(1, 6),
                lo=st.integers(1, 3), capacity=st.integers(1, 80), cached=st.integers(-1, 3),
                depth=st.integers(2, 10), chain=st.sampled_from([1, 6, 1 << 20, 1 << 20]))
    def setup(self, algorithm: str, k: int, lo: int, capacity: int, cached: int, depth: int,
              chain: int) -> None:
        self.params = SpecParams(
            algorithm, num_draft_tokens=k,  # type: ignore[arg-type]
            ngram_min_match_window_size=lo, ngram_max_match_window_size=lo + 3,
            ngram_capacity=capacity, suffix_max_tree_depth=depth,
            suffix_max_cached_requests=cached, suffix_max_cached_tokens=capacity,
            max_chain=chain, short_chain=chain)
        self.drafter: Drafter = make_drafter(self.params)
        self.tokens: dict[str, list[int]] = {}  # the live requests' tokens
        self.prompt_len: dict[str, int] = {}
        self.stored: list[list[int]] = []  # everything ever put into the shared memory
        self.drafts: dict[str, list[int]] = {}

    @rule(rid=st.sampled_from(RIDS), prompt=small_tokens)
    def start(self, rid: str, prompt: list[int]) -> None:
        if rid in self.tokens:
            return
        self.drafter.start(rid, prompt)
        self.tokens[rid], self.prompt_len[rid] = list(prompt), len(prompt)

    @precondition(lambda self: bool(self.tokens))
    @rule(rid=st.sampled_from(RIDS), data=st.data())
    def start_a_repeat(self, rid: str, data: st.DataObject) -> None:
        """A request whose prompt is the start of a live one's tokens (n > 1 samples, the
        same question twice): the live one, when ahead, drafts it."""
        source = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
        self.start(rid, source[:data.draw(st.integers(1, len(source)))])

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def propose(self, data: st.DataObject) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1,
                                  max_size=4))
        asked = data.draw(st.lists(st.integers(-1, 8), min_size=len(rids), max_size=len(rids)))
        drafts = self.drafter.propose(rids, asked)
        assert drafts == self.drafter.propose(rids, asked)  # proposing changes nothing
        min_len = self.params.ngram_min_match_window_size if self._ngram else 1
        for rid, k, draft in zip(rids, asked, drafts, strict=True):
            assert len(draft) <= max(0, min(k, self.params.num_draft_tokens))
            if draft:
                context = self.tokens[rid]
                others = [t for o, t in self.tokens.items() if o != rid and self._ngram]
                assert ref.occurs_after_match(draft, context, [context, *others, *self.stored],
                                              min_len), (rid, draft)
            self.drafts[rid] = draft

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), bonus=st.integers(0, 4), garbage=st.booleans())
    def accept(self, data: st.DataObject, bonus: int, garbage: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        draft = self.drafts.pop(rid, [])
        kept = data.draw(st.integers(0, len(draft)))
        run = [bonus] if garbage else [*draft[:kept], bonus]
        self.drafter.accept(rid, run)
        self.tokens[rid] += run

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), keep=st.booleans())
    def finish(self, data: st.DataObject, keep: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.drafter.finish(rid, keep=keep)
        tokens, prompt_len = self.tokens.pop(rid), self.prompt_len.pop(rid)
        self.drafts.pop(rid, None)
        stored = tokens if self._ngram else tokens[prompt_len:]
        if keep and stored and self._shared is not None:
            self.stored.append(stored)

    @rule()
    def flush(self) -> None:
        self.drafter.flush()
        if self._ngram and self.params.max_chain >= 1 << 20:
            self._drafts_equal_the_reference()

    def _drafts_equal_the_reference(self) -> None:
        """With its cursor dropped (a search, not a match followed), each request drafts
        what the reference does."""
        drafter = self.drafter
        assert isinstance(drafter, NgramDrafter)
        p, shared = self.params, ref.live_sequences(drafter.shared)
        for rid in sorted(self.tokens):
            drafter._reqs[rid].src = None
            expected = ref.ngram(self.tokens[rid], shared, p.num_draft_tokens,
                                 p.ngram_min_match_window_size, p.ngram_max_match_window_size,
                                 ref.live_others(drafter, rid), drafter.live.n)
            assert drafter.propose([rid], [p.num_draft_tokens]) == [expected], rid

    @invariant()
    def structures_hold_and_memory_is_bounded(self) -> None:
        if not hasattr(self, "drafter"):
            return
        self.drafter.check_integrity()
        shared = self._shared
        if shared is not None:
            if len(shared.sequences) > 1:
                assert shared.num_live_tokens <= (shared.max_tokens or 1 << 60)
            if shared.max_sequences is not None:
                assert len(shared.sequences) <= max(shared.max_sequences, 1)
            assert len(shared.tokens) <= 2 * shared.num_live_tokens + 1024  # compacted
        assert self.drafter.stats().active_requests == len(self.tokens)

    @property
    def _ngram(self) -> bool:
        return self.params.algorithm == "NGRAM"

    @property
    def _shared(self) -> TokenArena | None:
        return getattr(self.drafter, "shared", None)


TestDrafterMachine = DrafterMachine.TestCase
TestDrafterMachine.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
