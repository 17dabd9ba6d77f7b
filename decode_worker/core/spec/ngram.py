"""NGRAM: prompt lookup over the request's own tokens, the other live requests' tokens and a
shared memory of finished ones.

The draft follows the longest suffix of the request's tokens, between
`ngram_min_match_window_size` and `ngram_max_match_window_size` tokens long, that occurred
before: in its own prompt and output (vLLM's `ngram` proposer and SGLang's NGRAM on one
request); in the prompt and output of another request running now (two agents asking the same
thing, n > 1 samples of one prompt, near-identical tool calls: a `LiveIndex` maps a gram to
the requests holding it, so the cost does not grow with the batch; what that request had
indexed at the last `flush` is seen, and a match there is at least `LONG_ANCHOR` tokens long,
or the max window when shorter); or in the prompt and output of a request this worker finished
(SGLang's NGRAM keeps one trie shared by all requests, bounded by
`--speculative-ngram-capacity`; here a `TokenArena` of whole sequences, bounded in tokens,
oldest evicted first). The longest match wins; of equals, the request's own tokens, then the
live requests (the newest started first), then the finished ones; in each, the newest
occurrence. A match with nothing after it does not count. The draft is the `num_draft_tokens`
(at most) that followed the match, never past the end of that sequence; a match in the
request's own tokens whose continuation runs into its last token is a repeat of period `d`
(its distance from the end), and the draft goes on repeating it (a line of dashes, a loop: the
newest match of a run of one token has one token after it, not `num_draft_tokens`).

Once found, a match is followed as a cursor: while the accepted tokens are the ones that
followed it, the next draft is read on from there without a search (copying a file, a previous
answer, or another live request that is ahead costs a slice per step; a live request's draft
grows as that request goes on). A token that leaves it, or the end of the live request
followed, ends the cursor, and the next `propose` searches again.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_worker.core.spec.arena import SEP, TokenArena, gram_key
from decode_worker.core.spec.base import DrafterBase, ReqState, searchable
from decode_worker.core.spec.drafter import SpecParams
from decode_worker.core.spec.live import LiveIndex

LONG_ANCHOR = 5  # a selective gram: long matches are found among the newest occurrences of
# their last 5 tokens, not only of their last token (5 did as well as 8 on edit traces, and
# costs less to index)


def anchors_within(lo: int, hi: int) -> tuple[int, ...]:
    """Indexed gram lengths for matches of lo..hi tokens: lo itself (every match is found)
    and `LONG_ANCHOR` when it fits."""
    return tuple(sorted({lo, max(lo, min(LONG_ANCHOR, hi))}, reverse=True))


class _Req(ReqState):
    __slots__ = ("pos", "src", "via")

    def __init__(self, own: TokenArena, prompt_len: int) -> None:
        super().__init__(own, prompt_len)
        self.src: TokenArena | None = None  # the cursor: the arena of the match followed
        self.pos = -1  # ... and the position in it of the request's last token
        self.via: _Req | None = None  # ... and the live request that arena is, if another


class NgramDrafter(DrafterBase[_Req]):
    """NGRAM drafting (see the module docstring and `Drafter` for the contract)."""

    def __init__(self, params: SpecParams) -> None:
        anchors = anchors_within(params.ngram_min_match_window_size,
                                 params.ngram_max_match_window_size)
        super().__init__(anchors, TokenArena(anchors, max_tokens=params.ngram_capacity),
                         params.num_draft_tokens, live=True)
        self.shared: TokenArena
        self.live: LiveIndex
        self.lo = params.ngram_min_match_window_size
        self.hi = params.ngram_max_match_window_size
        self.max_chain = params.max_chain
        self.short_chain = params.short_chain

    def new_req(self, own: TokenArena, prompt_len: int) -> _Req:
        return _Req(own, prompt_len)

    def stored_tokens(self, r: _Req) -> list[int]:
        return r.own.tokens  # prompt and output

    def accept(self, rid: str, token_ids: Sequence[int]) -> None:
        r = self.req(rid)
        tokens = list(token_ids)
        self.appended(rid, r, tokens)
        src = r.src
        if src is None:
            return
        i = r.pos + 1 - src.base
        if r.pos >= src.start and src.tokens[i:i + len(tokens)] == tokens:
            r.pos += len(tokens)  # still the tokens that followed the match
        else:
            r.src = r.via = None

    def draft(self, r: _Req, k: int) -> list[int]:
        if r.src is not None and r.pos >= r.src.start and (r.via is None or r.via.alive):
            draft = self._follow(r, r.src, r.pos, k)
            if draft:
                return draft
        return self._search(r, k)

    @staticmethod
    def _follow(r: _Req, src: TokenArena, pos: int, k: int) -> list[int]:
        """Up to k tokens after `pos` in `src`; in the request's own tokens, a continuation
        that reaches its end repeats with period `end - 1 - pos`."""
        draft = src.continuation(pos, k)
        if src is r.own and draft and pos + 1 + len(draft) == src.end:
            period = len(draft)
            while len(draft) < k:
                draft.append(draft[len(draft) - period])
        return draft

    def _search(self, r: _Req, k: int) -> list[int]:
        """Own tokens, then the live requests, then the finished ones: a later memory is
        searched only while the match could be longer, and must beat it (ties stay)."""
        own = searchable(r.own)
        pattern = own.tokens[-self.hi:]
        best_len, best_pos = self._longest(own, pattern)
        best_src, via = own, None
        if best_len < self.hi:
            best_len, via, pos = self._longest_live(r, pattern, best_len)
            if via is not None:
                best_src, best_pos = via.own, pos
        if best_len < self.hi:
            length, pos = self._longest(self.shared, pattern)
            if length > best_len:
                best_len, best_src, best_pos, via = length, self.shared, pos, None
        if best_len < self.lo:
            r.src = r.via = None
            return []
        r.src, r.pos, r.via = best_src, best_pos, via
        return self._follow(r, best_src, best_pos, k)

    def _longest_live(self, r: _Req, pattern: list[int],
                      beat: int) -> tuple[int, _Req | None, int]:
        """The longest match longer than `beat` (and at least the live index's gram) in the
        shown tokens of the other live requests: (length, request, end position), or (beat,
        None, -1). The holders of the pattern's last gram are searched newest started first,
        each along its own chain (newest first), `max_chain` occurrences in all (as one
        search of the shared memory); a tie keeps the first found."""
        n = self.live.n
        if n > len(pattern):
            return beat, None, -1
        best, best_req, best_pos = max(beat, n - 1), None, -1
        limit = self.max_chain if n >= 3 else self.short_chain
        for o in self.live.newest(gram_key(pattern[-n:])):
            if o is r or not o.alive:
                continue
            length, pos, limit = o.own.longest(n, pattern, self.hi, limit, o.shown, best)
            if pos >= 0:
                best, best_req, best_pos = length, o, pos
            if limit <= 0 or best >= self.hi:
                break
        if best_req is None:
            return beat, None, -1
        assert isinstance(best_req, _Req)
        return best, best_req, best_pos

    def _longest(self, src: TokenArena, pattern: list[int]) -> tuple[int, int]:
        """(length, end position) of the longest match of a suffix of `pattern` in `src`
        that something follows, the newest of equals; (0, -1) for none. Longest anchors
        first: a match found with an anchor of n tokens is at least n long, longer than any
        a shorter anchor finds. The tokens not indexed yet are the newest: scanned first."""
        below = src.end - 1  # the request's own last position (in `own`) is no match
        best, best_pos = 0, -1
        if src.pending:
            for length, pos in src.find_unindexed(pattern, self.hi, self.max_chain, {below}):
                if length > best and src.token_at(pos + 1) != SEP:
                    best, best_pos = length, pos
        for n in src.anchors:
            if n > len(pattern):
                continue
            limit = self.max_chain if n >= 3 else self.short_chain
            length, pos, _ = src.longest(n, pattern, self.hi, limit, below, max(best, n - 1))
            if pos >= 0:
                best, best_pos = length, pos
            if best >= n:
                break
        return best, best_pos
