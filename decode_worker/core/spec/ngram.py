"""NGRAM: prompt lookup over the request's own tokens and a shared memory of finished ones.

The draft follows the longest suffix of the request's tokens, between
`ngram_min_match_window_size` and `ngram_max_match_window_size` tokens long, that occurred
before: in its own prompt and output (vLLM's `ngram` proposer and SGLang's NGRAM on one
request), or in the prompt and output of a request this worker finished (SGLang's NGRAM keeps
one trie shared by all requests, bounded by `--speculative-ngram-capacity`; here a
`TokenArena` of whole sequences, bounded in tokens, oldest evicted first). The longest match
wins, then the request's own tokens, then the newest occurrence; a match with nothing after it
does not count. The draft is the `num_draft_tokens` (at most) that followed the match; a match
in the request's own tokens whose continuation runs into its last token is a repeat of period
`d` (its distance from the end), and the draft goes on repeating it (a line of dashes, a loop:
the newest match of a run of one token has one token after it, not `num_draft_tokens`).

Once found, a match is followed as a cursor: while the accepted tokens are the ones that
followed it, the next draft is read on from there without a search (copying a file or a
previous answer costs a slice per step). A token that leaves it ends the cursor, and the next
`propose` searches again.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_worker.core.spec.arena import SEP, TokenArena
from decode_worker.core.spec.base import DrafterBase, ReqState, searchable
from decode_worker.core.spec.drafter import SpecParams

LONG_ANCHOR = 5  # a selective gram: long matches are found among the newest occurrences of
# their last 5 tokens, not only of their last token (5 did as well as 8 on edit traces, and
# costs less to index)


def anchors_within(lo: int, hi: int) -> tuple[int, ...]:
    """Indexed gram lengths for matches of lo..hi tokens: lo itself (every match is found)
    and `LONG_ANCHOR` when it fits."""
    return tuple(sorted({lo, max(lo, min(LONG_ANCHOR, hi))}, reverse=True))


class _Req(ReqState):
    __slots__ = ("pos", "src")

    def __init__(self, own: TokenArena, prompt_len: int) -> None:
        super().__init__(own, prompt_len)
        self.src: TokenArena | None = None  # the cursor: the arena of the match followed
        self.pos = -1  # ... and the position in it of the request's last token


class NgramDrafter(DrafterBase[_Req]):
    """NGRAM drafting (see the module docstring and `Drafter` for the contract)."""

    def __init__(self, params: SpecParams) -> None:
        anchors = anchors_within(params.ngram_min_match_window_size,
                                 params.ngram_max_match_window_size)
        super().__init__(anchors, TokenArena(anchors, max_tokens=params.ngram_capacity))
        self.shared: TokenArena
        self.k_max = params.num_draft_tokens
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
            r.src = None

    def propose(self, rids: Sequence[str], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = []
        for rid, k in zip(rids, max_tokens, strict=True):
            r = self.req(rid)
            k = min(k, self.k_max)
            if k <= 0:
                drafts.append([])
                continue
            if r.src is not None and r.pos >= r.src.start:
                draft = self._follow(r, r.src, r.pos, k)
                if draft:
                    drafts.append(draft)
                    continue
            drafts.append(self._search(r, k))
        return drafts

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
        own = searchable(r.own)
        pattern = own.tokens[-self.hi:]
        best_len, best_src, best_pos = 0, own, -1
        for src in (own, self.shared):
            length, pos = self._longest(src, pattern)
            if length > best_len:
                best_len, best_src, best_pos = length, src, pos
            if best_len == self.hi:  # the longest there is; the own tokens win ties
                break
        if best_len < self.lo:
            r.src = None
            return []
        r.src, r.pos = best_src, best_pos
        return self._follow(r, best_src, best_pos, k)

    def _longest(self, src: TokenArena, pattern: list[int]) -> tuple[int, int]:
        """(length, end position) of the longest match of a suffix of `pattern` in `src`
        that something follows, the newest of equals; (0, -1) for none. Longest anchors
        first: a match found with an anchor of n tokens is at least n long, longer than any
        a shorter anchor finds. The tokens not indexed yet are the newest: scanned first."""
        skip = src.end - 1  # the request's own last position (in `own`)
        best, best_pos = 0, -1
        if src.pending:
            for length, pos in src.find_unindexed(pattern, self.hi, self.max_chain, {skip}):
                if length > best and src.token_at(pos + 1) != SEP:
                    best, best_pos = length, pos
        for n in src.anchors:
            if n > len(pattern):
                continue
            limit = self.max_chain if n >= 3 else self.short_chain
            length, pos = src.longest(n, pattern, self.hi, limit, skip, max(best, n - 1))
            if pos >= 0:
                best, best_pos = length, pos
            if best >= n:
                break
        return best, best_pos
