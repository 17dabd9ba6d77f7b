"""Speculative decoding's policy: which requests draft, how many tokens, and whether a step
verifies drafts at all (speculation must never cost throughput).

Per request the draft length follows its recent acceptance: it grows while drafts are kept,
halves after a miss, and a request whose drafts keep failing pauses drafting for a while (a
pause that doubles with each further failure, up to `_MAX_PAUSE_STEPS`). Per step only the
drafts worth their cost are verified: requests are taken best expected acceptance first
(each request's acceptance estimate, per token) while each adds more tokens per second than
its `k` extra entries cost, from the runner's measured step time by entry count
(`StepCost`), and the step verifies only when that beats a plain step by `_MIN_GAIN`.

The drafter (`core/spec`'s `Drafter`, whose contract the verify step relies on) holds the
memory drafts come from; it sees a request's tokens when it joins the batch and its committed
tokens lazily, just before it drafts. Compute thread only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from decode_worker.core.spec.drafter import Drafter

_ALPHA_PRIOR = 0.3  # per-token acceptance assumed for a request before its first verify
_EMA = 0.5  # weight of the newest verify in a request's acceptance estimate
_MAX_PAUSE_STEPS = 64
_MIN_GAIN = 1.1  # a verify step must promise this much more tokens per second than plain


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
    of 1, 2, 4, ... entries), interpolated linearly between measured counts."""

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        pts = sorted(points)
        self.counts = [n for n, _ in pts]
        self.seconds = [s for _, s in pts]

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
    alpha: float = _ALPHA_PRIOR  # its per-token acceptance estimate
    seen: int = 0  # tokens the drafter has of it
    misses: int = 0  # verifies in a row that kept none of its drafts
    paused_until: int = 0  # the step from which it drafts again


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

    def joined(self, rid: str, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A request joins the batch with these tokens; a retracted one that joins again keeps
        its drafting state (its new tokens reach the drafter before it drafts)."""
        if rid in self._states:
            return
        self.drafter.start(rid, prompt_ids, output_ids)
        self._states[rid] = _State(self.k_max, seen=len(prompt_ids) + len(output_ids))

    def ended(self, rid: str, status: str) -> None:
        """The request ended ("finished" / "aborted" / "failed"): a failed one's tokens stay
        out of the shared memory."""
        if self._states.pop(rid, None) is not None:
            self.drafter.finish(rid, keep=status != "failed")

    def flush(self) -> None:
        self.drafter.flush()

    def may_draft(self) -> bool:
        """Some request of the batch may draft at the next step (else a plain, overlapped step
        needs no committed tokens first)."""
        nxt = self._step + 1
        if nxt < self._quiet_until:
            self._step = nxt  # a plain step: it counts toward the pauses
            return False
        return any(st.paused_until <= nxt for st in self._states.values())

    def drafts(self, rids: Sequence[str], tokens: Sequence[TokenView],
               caps: Sequence[int]) -> list[list[int]] | None:
        """Drafts for the batch's requests (`tokens`: each one's tokens so far; `caps`: the
        most each may draft, its tokens left - 1), or None when this step should not verify."""
        self._step += 1
        want, asked = [], []
        for rid, toks, cap in zip(rids, tokens, caps, strict=True):
            st = self._states.get(rid)
            if st is None or st.paused_until > self._step or cap <= 0:
                want.append(0)
                continue
            if len(toks) > st.seen:
                self.drafter.accept(rid, toks.tail(st.seen))
                st.seen = len(toks)
            want.append(min(st.k, cap))
            asked.append(rid)
        if not asked:
            return None
        ks = [w for w in want if w]
        got = iter(self.drafter.propose(asked, ks))
        out = [next(got)[:w] if w else [] for w in want]
        worth = self._worth(rids, out)
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
            kept = len(run) - 1
            st_all.accept_lengths.append(len(run))
            if st is None or not draft:
                continue
            st_all.proposed_total += len(draft)
            st_all.accepted_total += kept
            st.alpha = (1 - _EMA) * st.alpha + _EMA * (kept / len(draft))
            if kept == len(draft):
                st.k, st.misses = min(self.k_max, st.k + 2), 0
            elif kept:
                st.k, st.misses = max(1, min(st.k, kept + 1)), 0
            else:
                st.k, st.misses = max(1, st.k // 2), st.misses + 1
                if st.misses >= 2:
                    st.paused_until = self._step + min(_MAX_PAUSE_STEPS, 2 ** st.misses)

    def _worth(self, rids: Sequence[str], drafts: list[list[int]]) -> list[list[int]] | None:
        """The drafts worth verifying: requests are taken best expected acceptance first while
        each adds more tokens per second than it costs (`cost` of the step's entries); None
        when even the best do not beat a plain step by `_MIN_GAIN`."""
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
        entries, earned, kept = n, float(n), set()
        for i in sorted(gain, key=lambda i: gain[i] / len(drafts[i]), reverse=True):
            more, got = entries + len(drafts[i]), earned + gain[i]
            if got / self.cost(more) <= earned / self.cost(entries):
                break  # the rest earn less per entry still
            entries, earned = more, got
            kept.add(i)
        if not kept or earned / self.cost(entries) < _MIN_GAIN * n / self.cost(n):
            return None
        return [d if i in kept else [] for i, d in enumerate(drafts)]
