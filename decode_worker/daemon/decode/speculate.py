"""Speculative decoding's policy: which requests draft, how many tokens, and whether a step
verifies drafts at all (speculation must never cost throughput).

Per request the draft length follows its recent acceptance: it grows while drafts are kept,
shrinks after a miss, and a request whose drafts keep failing pauses drafting for a while (a
pause that doubles with each further failure, up to `_MAX_PAUSE_STEPS`). Its acceptance
estimate (per draft token, given the ones before it were kept) counts every verify, and also
every draft the policy declined: those are checked against the tokens the request then
produced (in expectation the same as a verify's acceptance, greedy or sampled), so an estimate
follows the text without costing a verify. Per step only the drafts worth their cost are
verified: requests ranked by expected kept tokens per draft token, the leading set that earns
the most tokens per second by `StepCost` (the runner's start-up table of step time by entry
count, plus what steps here took beyond it, learnt as the server runs), and the step verifies
only when that beats a plain step by `_MIN_GAIN`; after a step with nothing worth verifying,
the next 1, 2, 4, ... `_MAX_PAUSE_STEPS` steps are plain (and overlapped), but for a request
that just joined, which drafts alone until a draft of it is measured.

The drafter (`core/spec`'s `Drafter`, whose contract the verify step relies on) holds the
memory drafts come from; it sees a request's tokens when it joins the batch and its committed
tokens lazily, just before it drafts. Compute thread only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from decode_worker.core.spec.drafter import Drafter

_ALPHA_PRIOR = 0.3  # per-token acceptance assumed for a request before anything is measured
_PRIOR_TOKENS = 0.5  # ... weighing as much as this many measured draft tokens
_DECAY = 0.7  # weight of the earlier measurements' counts at each new one
_MAX_PAUSE_STEPS = 64
_MIN_GAIN = 1.1  # a verify step must promise this much more tokens per second than plain
_OBSERVE = 0.1  # weight of the newest step in the measured-minus-table time of its kind


class TokenView:
    """A request's tokens so far, its prompt then its output, without copying them."""

    __slots__ = ("output", "prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def tail(self, start: int) -> list[int]:
        """The tokens from index `start` on."""
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n:]
        return self.prompt[start:] + self.output


class StepCost:
    """A decode step's time by its entry count (calibrated at start-up: `ModelRunner` steps
    of 1, 2, 4, ... entries), interpolated linearly between measured counts. `verify`: the
    same for verify steps (requests of 1 + K entries; a kernel may read a request's KV once
    for all of them), when measured apart; else verify entries cost as plain ones.

    A start-up measurement can only be too slow (other load adds time, never takes it): a
    count measured slower than a larger one takes the larger one's time, and a verify step of
    E entries, which runs the forward a plain step of E entries runs, costs at most that. A
    plain step's noise is learnt away while serving (plain steps run all the time); a verify
    step's would not be, as a step the table prices too high never runs to be measured."""

    def __init__(self, points: Sequence[tuple[int, float]],
                 verify: Sequence[tuple[int, float]] | None = None) -> None:
        pts = sorted(points)
        self.counts = [n for n, _ in pts]
        self.seconds = list(accumulate(reversed([s for _, s in pts]), min))[::-1]
        self.verify = (StepCost([(n, min(s, self(n))) for n, s in verify]) if verify
                       else self)

    def __call__(self, entries: int) -> float:
        c, s = self.counts, self.seconds
        if entries <= c[0]:
            return s[0]
        i = bisect.bisect_left(c, entries)
        if i == len(c):  # past the largest measured: grow as the last segment does
            i = len(c) - 1
        n0, n1, s0, s1 = c[i - 1], c[i], s[i - 1], s[i]
        return s0 + (s1 - s0) * (entries - n0) / (n1 - n0)


@dataclass(slots=True)
class _State:
    """One request's drafting state."""

    k: int  # the draft length it asks for next
    seen: int = 0  # tokens the drafter has of it
    misses: int = 0  # measurements in a row that kept none of its drafts
    paused_until: int = 0  # the step from which it drafts again
    shadow: list[int] | None = None  # a declined draft, for the tokens `seen` on
    fresh: bool = True  # nothing measured yet: it drafts even in the quiet steps
    kept_w: float = 0.0  # draft tokens kept and tried, earlier measurements decayed
    tried_w: float = 0.0

    @property
    def alpha(self) -> float:
        """Its per-token acceptance estimate: the decayed counts with the prior as
        `_PRIOR_TOKENS` tokens (two of two kept says 0.86, not 1)."""
        return (self.kept_w + _ALPHA_PRIOR * _PRIOR_TOKENS) / (self.tried_w + _PRIOR_TOKENS)

    def measure(self, draft: Sequence[int], got: Sequence[int]) -> int:
        """Count the draft against the tokens that came (`got`: as many as are known); the
        tokens of the draft kept. Each token compared up to the first refused one is a try:
        the refused one is, those after it are not."""
        self.fresh = False
        kept = 0
        for d, t in zip(draft, got, strict=False):
            if d != t:
                break
            kept += 1
        tried = kept + (kept < min(len(draft), len(got)))
        self.kept_w = _DECAY * self.kept_w + kept
        self.tried_w = _DECAY * self.tried_w + tried
        return kept


@dataclass(slots=True)
class SpecStats:
    """What speculation did, for the metrics: draft tokens proposed and kept, verify steps
    (a request in a verify step counts once), the tokens each verify committed per request."""

    proposed_total: int = 0
    accepted_total: int = 0
    verify_steps_total: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # drained by the books


class Speculator:
    """The policy over `drafter`, at most `num_draft_tokens` per request per step."""

    def __init__(self, drafter: Drafter, num_draft_tokens: int, cost: StepCost | None) -> None:
        self.drafter, self.k_max, self.cost = drafter, num_draft_tokens, cost
        self.stats = SpecStats()
        self._states: dict[str, _State] = {}
        self._step = 0
        # after steps that found nothing worth verifying, plain (overlapped) steps for a while
        self._quiet_until, self._quiet_len = 0, 1
        # what a step takes beyond the table (plain, verify): the host's own work per step
        self._extra = [0.0, 0.0]
        self._stored_waiting = False  # a request ended since the drafter's last flush

    def joined(self, rid: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A request joins the batch with these tokens; a retracted one that joins again keeps
        its drafting state (its new tokens reach the drafter before it drafts)."""
        if rid in self._states:
            return
        self.drafter.start(rid, prompt_ids, output_ids)
        # fresh: it drafts at the next step even in quiet steps (it may repeat what the
        # others found nothing in), alone, until a draft of it is measured
        self._states[rid] = _State(self.k_max, seen=len(prompt_ids) + len(output_ids))

    def ended(self, rid: str, status: str) -> None:
        """The request ended ("finished" / "aborted" / "failed"): a failed one's tokens stay
        out of the shared memory."""
        if self._states.pop(rid, None) is not None:
            self.drafter.finish(rid, keep=status != "failed")
            self._stored_waiting = True

    def flush(self) -> None:
        """The drafter's deferred indexing (call while the device computes a step)."""
        self.drafter.flush()
        self._stored_waiting = False

    def observe_step(self, entries: int, seconds: float, verify: bool) -> None:
        """A step of `entries` entries took `seconds` (drafting, commits and all): the policy
        prices steps by the table plus what steps here took beyond it (start-up calibration
        times only the forward; the host's work per step is learnt as the server runs)."""
        if self.cost is None:
            return
        table = self._table(entries, verify)
        beyond = min(max(seconds - table, -0.5 * table), 3 * table)  # one slow step: bounded
        self._extra[verify] += _OBSERVE * (beyond - self._extra[verify])

    def _table(self, entries: int, verify: bool) -> float:
        """The start-up table's time for a step of `entries` entries."""
        assert self.cost is not None
        return self.cost.verify(entries) if verify else self.cost(entries)

    def _seconds(self, entries: int, verify: bool) -> float:
        """What a step of `entries` entries is expected to take."""
        table = self._table(entries, verify)
        return max(table + self._extra[verify], 0.25 * table)

    def may_draft(self) -> bool:
        """Some request of the batch may draft at the next step (else a plain, overlapped step
        needs no committed tokens first)."""
        nxt = self._step + 1
        quiet = nxt < self._quiet_until
        if not any(st.paused_until <= nxt and (st.fresh or not quiet)
                   for st in self._states.values()):
            self._step = nxt  # a plain step: it counts toward the pauses and the quiet
            return False
        return True

    def drafts(self, rids: Sequence[str], tokens: Sequence[TokenView],
               caps: Sequence[int]) -> list[list[int]] | None:
        """Drafts for the batch's requests (`tokens`: each one's tokens so far; `caps`: the
        most each may draft, its tokens left - 1), or None when this step should not verify."""
        self._step += 1
        quiet = self._step < self._quiet_until  # only fresh requests draft
        want, asked = [], []
        for rid, toks, cap in zip(rids, tokens, caps, strict=True):
            st = self._states.get(rid)
            if st is None or st.paused_until > self._step or cap <= 0 or (quiet
                                                                           and not st.fresh):
                want.append(0)
                continue
            if len(toks) > st.seen:
                new = toks.tail(st.seen)
                self.drafter.accept(rid, new)
                st.seen = len(toks)
                if st.shadow is not None:  # what a declined draft would have kept
                    self._adapt(st, len(st.shadow), st.measure(st.shadow, new))
                    st.shadow = None
            want.append(min(st.k, cap))
            asked.append(rid)
        if not asked:
            return None
        if self._stored_waiting:  # drafts may follow an ended request's answer from this step on
            self.flush()
        ks = [w for w in want if w]
        got = iter(self.drafter.propose(asked, ks))
        out = [next(got)[:w] if w else [] for w in want]
        worth = self._worth(rids, out)
        for rid, draft, verified in zip(rids, out, worth or [[]] * len(out), strict=True):
            if draft and not verified:
                self._states[rid].shadow = draft  # measured when its next tokens come
        if quiet:  # fresh requests only: the batch's backoff is not theirs to change
            return worth
        if worth is None:  # back off: the next steps stay plain (and overlapped)
            self._quiet_until = self._step + self._quiet_len
            self._quiet_len = min(_MAX_PAUSE_STEPS, self._quiet_len * 2)
        else:
            self._quiet_len = 1
        return worth

    def record(self, rids: Sequence[str], drafts: Sequence[Sequence[int]],
               runs: Sequence[Sequence[int]]) -> None:
        """A verify step committed `runs` (kept drafts + the bonus) for drafts `drafts`."""
        st_all = self.stats
        st_all.verify_steps_total += 1
        for rid, draft, run in zip(rids, drafts, runs, strict=True):
            st = self._states.get(rid)
            st_all.accept_lengths.append(len(run))
            if st is None or not draft:
                continue
            kept = st.measure(draft, run)
            st_all.proposed_total += len(draft)
            st_all.accepted_total += kept
            self._adapt(st, len(draft), kept)

    def _adapt(self, st: _State, drafted: int, kept: int) -> None:
        """The next draft length and pause after `kept` of `drafted` tokens were kept."""
        if kept == drafted:
            st.k, st.misses = min(self.k_max, st.k + 2), 0
        elif kept:
            st.k, st.misses = max(1, min(st.k, kept + 1)), 0
        else:
            st.k, st.misses = max(1, st.k // 2), st.misses + 1
            if st.misses >= 2:
                st.paused_until = self._step + min(_MAX_PAUSE_STEPS, 2 ** st.misses)

    def _worth(self, rids: Sequence[str], drafts: list[list[int]]) -> list[list[int]] | None:
        """The drafts worth verifying: of the requests ranked by expected kept tokens per draft
        token, the leading set whose step earns the most tokens per second (the cost of a
        step is not linear in its entries, so every prefix is priced, not only the next
        request); None when even that set does not beat a plain step by `_MIN_GAIN`."""
        if not any(drafts):
            return None
        if self.cost is None:
            return drafts
        n = len(drafts)
        gain = {}  # request index -> expected kept drafts
        for i, (rid, d) in enumerate(zip(rids, drafts, strict=True)):
            if d:
                a = self._states[rid].alpha
                gain[i] = sum(a ** j for j in range(1, len(d) + 1))
        ranked = sorted(gain, key=lambda i: gain[i] / len(drafts[i]), reverse=True)
        entries, earned = n, float(n)
        best, best_m = 0.0, 0
        for m, i in enumerate(ranked, 1):
            entries, earned = entries + len(drafts[i]), earned + gain[i]
            rate = earned / self._seconds(entries, True)
            if rate > best:
                best, best_m = rate, m
        if best < _MIN_GAIN * n / self._seconds(n, False):
            return None
        kept = set(ranked[:best_m])
        return [d if i in kept else [] for i, d in enumerate(drafts)]
