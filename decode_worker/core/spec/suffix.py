"""SUFFIX: suffix decoding (arXiv 2411.04975) as SGLang's SUFFIX and vLLM's `suffix` run it
through Arctic Inference's `SuffixDecodingCache`, over `TokenArena`s instead of suffix trees.

Memories: the request's own prompt and output (arctic's per-request prompt tree) and the
responses of finished requests (its global tree; FIFO over `suffix_max_cached_requests`, and
at most `suffix_max_cached_tokens` tokens). The pattern is the request's last
`suffix_max_tree_depth` (D) tokens. For each match length m (1 .. D-1, the suffixes of the
pattern that occurred), the occurrences of that suffix vote: the draft follows, token by
token, the continuation most of them share (the newest among equals); a token's probability is
the product of the shares so far, and the draft stops below `suffix_min_token_prob`, after
min(num_draft_tokens, floor(suffix_max_spec_factor x m)) tokens, or at depth D (m + drafted
tokens). Its score is the sum of its tokens' probabilities; the best score over m wins (the
longer match on ties), then the best of the two memories (the request's own on ties): arctic's
`SuffixTree.speculate` with `use_tree_spec=False` (a chain).

Differences by design: arctic counts every occurrence in its trees; a search here looks at the
newest `max_chain` occurrences of the pattern's last 5 tokens and the newest few of its last
token (the counts are those of recent history), which bounds a step's cost whatever the
memory holds. The request's current position is not an occurrence (arctic counts it, with
nothing after it, which halves the probability of a match seen once before). A response
joins the shared memory when its request finishes (at the next `flush`), not token by token.
Between searches the occurrences found are carried forward: after `accept`, those the
accepted tokens continue are the occurrences of the longer match, and a new search runs only
when they cannot prove the best draft (a shorter match could still score more) or the shared
memory changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decode_worker.core.spec.arena import SEP, TokenArena
from decode_worker.core.spec.base import DrafterBase, ReqState, searchable
from decode_worker.core.spec.drafter import SpecParams
from decode_worker.core.spec.ngram import LONG_ANCHOR

Found = list[tuple[int, int]]  # (match length, end position) of occurrences, newest first


@dataclass(slots=True)
class _Draft:
    score: float = 0.0
    token_ids: list[int] = field(default_factory=list)


class _Req(ReqState):
    __slots__ = ("found", "shared_version")

    def __init__(self, own: TokenArena, prompt_len: int) -> None:
        super().__init__(own, prompt_len)
        self.found: dict[int, Found] = {}  # per memory (0 own, 1 shared): carried occurrences
        self.shared_version = -1  # the shared memory's version `found[1]` was searched in


class SuffixDrafter(DrafterBase[_Req]):
    """SUFFIX drafting (see the module docstring and `Drafter` for the contract)."""

    def __init__(self, params: SpecParams) -> None:
        depth = params.suffix_max_tree_depth
        anchors = tuple(sorted({1, max(1, min(LONG_ANCHOR, depth - 1))}, reverse=True))
        cached = params.suffix_max_cached_requests
        shared = None if cached == 0 else TokenArena(
            anchors, params.suffix_max_cached_tokens, None if cached < 0 else cached)
        super().__init__(anchors, shared, params.num_draft_tokens)
        self.depth = depth
        self.factor = params.suffix_max_spec_factor
        self.min_prob = params.suffix_min_token_prob
        self.max_chain = params.max_chain
        self.short_chain = params.short_chain
        self._room_tables: dict[int, list[int]] = {}

    def new_req(self, own: TokenArena, prompt_len: int) -> _Req:
        return _Req(own, prompt_len)

    def stored_tokens(self, r: _Req) -> list[int]:
        return r.own.tokens[r.prompt_len:]  # the response, as arctic's global tree keeps

    def accept(self, rid: str, token_ids: Sequence[int]) -> None:
        r = self.req(rid)
        tokens = list(token_ids)
        self.appended(rid, r, tokens)
        for which, found in r.found.items():
            if found:
                src = r.own if which == 0 else self.shared
                assert src is not None
                r.found[which] = _carry(src, found, tokens, self.depth - 1)

    def draft(self, r: _Req, k: int) -> list[int]:
        best = self._draft(r, 0, r.own, k)
        if self.shared is not None and best.score < k:  # k: nothing scores more
            if r.shared_version != self.shared_version:
                r.found.pop(1, None)
                r.shared_version = self.shared_version
            other = self._draft(r, 1, self.shared, k, best.score)
            if other.score > best.score:
                best = other
        return best.token_ids

    def _rooms(self, k: int) -> list[int]:
        """`rooms[m]` for m in 0 .. D: the most tokens a match of m may draft (K, the spec
        factor, the tree depth); then `rooms[-1 - m]`: the most for any match of 1 .. m (a
        match of m is also one of every shorter length)."""
        rooms = self._room_tables.get(k)
        if rooms is None:
            rooms = [min(k, int(m * self.factor + 1e-6), self.depth - m)
                     for m in range(self.depth + 1)]
            upto = [max(rooms[1:m + 1], default=0) for m in range(self.depth + 1)]
            rooms += upto[::-1]
            self._room_tables[k] = rooms
        return rooms

    def _draft(self, r: _Req, which: int, src: TokenArena, k: int,
               bar: float = 0.0) -> _Draft:
        """The best draft from one memory: from the carried occurrences when they prove it
        (no shorter match, which they may not all be, could score more), else from a new
        search (whose occurrences are carried from then on) that gives up on matches too
        short to score more than `bar` (what another memory offers)."""
        rooms = self._room_tables.get(k) or self._rooms(k)
        found = r.found.get(which)
        if found:
            if len(found) == 1:  # one occurrence (copying): all of it, probability 1
                length, pos = found[0]
                draft = src.continuation(pos, rooms[-1 - length])
                best = _Draft(float(len(draft)), draft)
            else:
                best = self._evaluate(src, found, rooms, 0, _Draft())
            shortest = min(length for length, _ in found)
            if best.score >= rooms[-shortest]:  # the most room of a match of 1 .. shortest-1
                return best
        pattern = searchable(r.own).tokens[-self.depth:]
        best, r.found[which] = self._search(src, pattern, rooms, bar)
        return best

    def _search(self, src: TokenArena, pattern: list[int], rooms: list[int],
                bar: float) -> tuple[_Draft, Found]:
        """Longest anchors first; stop once no shorter match could score more than the best
        so far or `bar`. The request's own last position (the pattern itself) is no
        occurrence."""
        max_m = min(self.depth, len(pattern)) - 1
        if max_m < 1:
            return _Draft(), []
        best, seen, upper = _Draft(), {src.end - 1}, max_m
        found = (src.find_unindexed(pattern, max_m, self.max_chain, seen) if src.pending
                 else [])
        for n in src.anchors:
            if n > max_m:
                continue
            found += src.find(n, pattern, max_m, self.max_chain if n > 1 else self.short_chain,
                              seen)
            if found:
                best = self._evaluate(src, found, rooms, n - 1, best, upper)
            upper = n - 1
            if rooms[-1 - upper] <= max(best.score, bar):
                break
        return best, found

    def _evaluate(self, src: TokenArena, found: Found, rooms: list[int], floor: int,
                  best: _Draft, upper: int = 1 << 30) -> _Draft:
        """`best` or a better draft for match lengths m in (floor, upper], longest first.
        The occurrences of a match of m are those found at least m long: between two of
        their lengths the set is the same, and it drafts with the most room in that span
        (the depth bound makes it not always the longest m's)."""
        lengths = sorted({ln for ln, _ in found if ln > floor}, reverse=True)
        for i, top in enumerate(lengths):
            low = max(lengths[i + 1] if i + 1 < len(lengths) else floor, floor)
            high = min(top, upper)  # m in (low, high] sees the occurrences >= top long
            if low >= high:
                continue
            room = max(rooms[low + 1:high + 1])
            if room > best.score:
                ends = sorted((p for ln, p in found if ln >= top), reverse=True)
                draft = self._walk(src, ends, room)
                if draft.score > best.score:  # m descends: a tie keeps the longer match
                    best = draft
        return best

    def _walk(self, src: TokenArena, ends: list[int], room: int) -> _Draft:
        """Follow the continuation most occurrences (`ends`, newest first) share, for at most
        `room` tokens; of equally common ones, the newest occurrence's."""
        tokens, base, stop = src.tokens, src.base, src.end - 1
        prob, score, out = 1.0, 0.0, list[int]()
        while len(out) < room and ends:
            if len(ends) == 1:  # one occurrence: the rest of it, at the same probability
                rest = src.continuation(ends[0], room - len(out))
                return _Draft(score + prob * len(rest), out + rest)
            counts: dict[int, int] = {}
            for p in ends:
                t = tokens[p + 1 - base] if p < stop else SEP
                if t != SEP:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # the first (newest) of the most
            prob *= counts[token] / len(ends)
            if prob < self.min_prob:
                break
            out.append(token)
            score += prob
            ends = [p + 1 for p in ends if p < stop and tokens[p + 1 - base] == token]
        return _Draft(score, out)


def _carry(src: TokenArena, found: Found, tokens: list[int], max_m: int) -> Found:
    """The occurrences that `tokens` continue, moved past them (the longer match)."""
    n, base, start = len(tokens), src.base, src.start
    return [(min(length + n, max_m), pos + n) for length, pos in found
            if pos >= start and src.tokens[pos + 1 - base:pos + 1 + n - base] == tokens]
