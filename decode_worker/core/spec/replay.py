"""Replaying known responses through a drafter: what speculation would earn on them.

For one request: `start` it with its prompt, then walk its response. At each position the
drafter proposes up to K tokens; the accepted ones are the longest prefix of the draft that
equals the response's next tokens (greedy verification of a chain); the step then commits
them plus one more token (the target's own, the bonus), so it advances accepted + 1 tokens.
One such step is one verify forward. When the response is done the request is `finish`ed, so
the next one finds it in the shared memory, as on the worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decode_worker.core.spec.drafter import Drafter

Clock = Callable[[], float]


@dataclass(slots=True)
class ReplayStats:
    """Totals over replayed requests. Times are seconds of `clock` (CPU time by default)."""

    records: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    verify_steps: int = 0
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted (bonus tokens not counted)
    draft_s: float = 0.0  # in propose + accept: on the decode step's critical path
    flush_s: float = 0.0  # in the per-step flush (indexing accepted tokens): off it
    start_finish_s: float = 0.0  # in start + finish (and the flush after each)

    @property
    def accept_length(self) -> float:
        """Output tokens per verify step, the bonus token included (SGLang's
        `spec_accept_length`); 1.0 is no gain."""
        return self.output_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def efficiency(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def draft_us_per_step(self) -> float:
        """Drafting CPU time per verify step: propose, accept and the per-step flush."""
        steps = self.verify_steps
        return (self.draft_s + self.flush_s) / steps * 1e6 if steps else 0.0

    @property
    def critical_us_per_step(self) -> float:
        """The part on the decode step's critical path: propose and accept."""
        return self.draft_s / self.verify_steps * 1e6 if self.verify_steps else 0.0

    def add(self, other: ReplayStats) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def replay(drafter: Drafter, rid: str, prompt: Sequence[int], response: Sequence[int],
           k: int, clock: Clock = time.process_time) -> ReplayStats:
    """Replay one request (see the module docstring) and return its own totals. The deferred
    work runs where the decode step runs it: `flush` between `propose` and `accept` (while
    the verify forward would run), and after `start` and `finish` (counted with them)."""
    stats = ReplayStats(records=1, prompt_tokens=len(prompt), output_tokens=len(response))
    t0 = clock()
    drafter.start(rid, prompt)
    drafter.flush()
    stats.start_finish_s += clock() - t0
    i = 0
    while i < len(response):
        t0 = clock()
        draft = drafter.propose([rid], [k])[0]
        t1 = clock()
        drafter.flush()
        t2 = clock()
        accepted = common_prefix(draft, response, i)
        run = response[i:i + accepted + 1]
        t3 = clock()
        drafter.accept(rid, run)
        stats.draft_s += (t1 - t0) + (clock() - t3)
        stats.flush_s += t2 - t1
        stats.proposed += len(draft)
        stats.accepted += accepted
        stats.verify_steps += 1
        i += len(run)
    t0 = clock()
    drafter.finish(rid)
    drafter.flush()
    stats.start_finish_s += clock() - t0
    return stats


def common_prefix(draft: Sequence[int], response: Sequence[int], at: int) -> int:
    """How many of `draft`'s tokens equal `response[at:]`'s, from the first on."""
    n = 0
    for token, actual in zip(draft, response[at:at + len(draft)], strict=False):
        if token != actual:
            break
        n += 1
    return n
