"""The drafter contract the decode step relies on, and the knobs of both drafters.

A drafter proposes, for each running request, tokens that may follow its current tokens,
from what this worker already holds (no draft model): the request's own prompt and output,
a shared memory of the requests it finished, and (NGRAM) the other requests running now. The
decode step verifies the drafts with one target forward over 1 + k tokens per request and
commits what it accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Algorithm = Literal["NGRAM", "SUFFIX"]


class Drafter(Protocol):
    """Per-request drafting state plus a memory shared by all requests.

    Contract (the verify side relies on every line):
    - Calls come from one thread (the compute thread); nothing here blocks or does I/O, and
      no call raises for a well-formed sequence of calls.
    - `start(rid, prompt_ids, output_ids)` begins a request whose tokens so far are
      `prompt_ids + output_ids` (`output_ids`: tokens it already has, e.g. the first token
      from prefill). Raises `InvalidTransition` if `rid` is active. A rid may be reused
      once it is finished.
    - `propose(rids, max_tokens)` returns one draft per rid (same order): at most
      `max_tokens[i]` tokens (0 or less: an empty draft) that would follow request i's
      current tokens; often empty. A draft is a chain: draft[0] follows the last token,
      draft[1] follows draft[0], and so on. Every draft is a run of tokens that occurred,
      right after a match of the request's latest tokens, in the memory it was taken from.
      Proposing changes no state the output depends on: asking again with the same
      arguments, with no `accept`, `finish` or `flush` between, gives the same drafts. The
      drafts depend only on tokens (never on sampling): the caller verifies them and may
      ask for fewer than K (a request near its length limit, a back-off after misses).
      Unknown rids raise `InvalidTransition`. Cost: a slice per request while it follows
      something it has seen, a few dict lookups and slice compares otherwise.
    - `accept(rid, token_ids)` commits the tokens the step kept for the request, in order
      (`StepCommit.commit_runs`' run: the accepted draft prefix and the bonus token, or the
      one token of a step without a draft). Nothing rejected is ever passed: the drafter
      holds committed tokens only. Tokens may be any ids (they need not come from a draft).
    - `finish(rid)` ends the request: its tokens go to the shared memory (NGRAM: prompt
      and output; SUFFIX: the output, as SGLang's global suffix tree keeps responses) at
      the next `flush`, and its per-request state is freed; from the call on, the other
      requests no longer draft from its live tokens. `finish(rid, keep=False)` frees
      without storing (a request that failed). Unknown rids are ignored (finishing twice is
      harmless).
    - `flush()` does the work that can wait: indexing the tokens started and accepted since
      the last flush (NGRAM: what the other live requests see of them), storing finished
      requests. Call it where it costs nothing, e.g. right after launching the verify
      forward; every other call is correct without it (a search scans what is not indexed
      yet, and indexes a request first past `MAX_PENDING` tokens), only slower, and (NGRAM)
      without it the other live requests see none of the new tokens.
    - Memory is bounded: the shared memory by its settings, per request by its tokens.
    - `stats()` counts what is held; `check_integrity()` raises AssertionError on a broken
      structure (tests, or the daemon's idle check).
    """

    def start(self, rid: str, prompt_ids: Sequence[int],
              output_ids: Sequence[int] = ()) -> None: ...

    def propose(self, rids: Sequence[str], max_tokens: Sequence[int]) -> list[list[int]]: ...

    def accept(self, rid: str, token_ids: Sequence[int]) -> None: ...

    def finish(self, rid: str, keep: bool = True) -> None: ...

    def flush(self) -> None: ...

    def stats(self) -> DrafterStats: ...

    def check_integrity(self) -> None: ...


@dataclass(frozen=True, slots=True)
class DrafterStats:
    """What the shared memory and the live requests hold (for metrics and /server_info)."""

    active_requests: int
    shared_sequences: int
    shared_tokens: int


@dataclass(frozen=True, slots=True)
class SpecParams:
    """The drafters' knobs, under SGLang's names (`--speculative-*`; docs/DEPLOY.md).

    NGRAM: `ngram_min_match_window_size` .. `ngram_max_match_window_size` is the length of the
    matched suffix; `ngram_capacity` bounds the shared memory in tokens (oldest sequences
    evicted first). SUFFIX: the pattern is the last `suffix_max_tree_depth` tokens; a draft is
    at most `num_draft_tokens` long and at most `suffix_max_spec_factor` x the match length;
    tokens whose estimated probability falls below `suffix_min_token_prob` end it;
    `suffix_max_cached_requests` responses are kept (FIFO; 0: no shared memory).
    A search looks at the newest `max_chain` occurrences of the pattern's last few tokens,
    and the newest `short_chain` of its last token alone (common, weak matches).
    """

    algorithm: Algorithm
    num_draft_tokens: int = 8
    ngram_min_match_window_size: int = 1
    ngram_max_match_window_size: int = 12
    ngram_capacity: int = 1_000_000
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 10_000
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_max_cached_tokens: int = 1_000_000
    max_chain: int = 16
    short_chain: int = 4


def make_drafter(params: SpecParams) -> Drafter:
    """The drafter `params.algorithm` names."""
    if params.algorithm == "NGRAM":
        from decode_worker.core.spec.ngram import NgramDrafter

        return NgramDrafter(params)
    from decode_worker.core.spec.suffix import SuffixDrafter

    return SuffixDrafter(params)
