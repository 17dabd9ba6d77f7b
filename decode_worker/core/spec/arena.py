"""TokenArena: token sequences in one list, with hash chains over their n-grams (the match
finder of an LZ77 compressor such as zlib's, keyed by token grams instead of bytes).

Positions are absolute and only grow; `tokens[p - base]` holds position p. A stored sequence
ends with `SEP` (never a token id), so no gram match and no continuation crosses two
sequences. For every anchor length n, `heads[n][key]` is the newest position p whose gram
`tokens[p-n+1 .. p]` has that key and `prevs[n][p - base]` the previous one (-1: none), so
the occurrences of a gram are walked newest first, as far as the caller wants. A key is exact
for n <= 3 and ids below 2**21, a hash otherwise: every candidate is verified token by token,
so a colliding key costs a wasted step, never a wrong match.

    position:  base ........ start ........................ end
    tokens:    [evicted, kept until compaction][live sequences][ <- appends ]

Eviction (bounded arenas) drops whole sequences, oldest first: `start` moves past them, and
chain walks stop at the first position below `start` (chains run newest to oldest). When the
dead prefix outgrows the live part it is cut off and stale heads are dropped, so memory stays
within a constant factor of the live tokens. Grams are indexed lazily (`index()`): an append
costs a list extend, the owner indexes in bulk when it has time, and searches scan what is
not indexed yet (`find_unindexed`). Not thread-safe.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator, Sequence

SEP = -1  # ends a stored sequence; never a token id
MAX_PENDING = 512  # appended tokens left unindexed at most (each search scans them)


def gram_keys(tokens: Sequence[int], n: int) -> list[int]:
    """The key of every gram of length n in `tokens` (len(tokens) - n + 1 of them): the token
    itself for n = 1, else the hash of the gram's tuple (computed in C: map over zip)."""
    if n == 1:
        return list(tokens)
    return list(map(hash, zip(*[tokens[i:] for i in range(n)], strict=False)))


def gram_key(gram: list[int]) -> int:
    """The key of one gram (as `gram_keys` computes it)."""
    return gram[0] if len(gram) == 1 else hash(tuple(gram))


class TokenArena:
    """Sequences of token ids with n-gram hash chains (see the module docstring).

    `anchors` are the gram lengths indexed (each >= 1). `max_tokens` / `max_sequences` bound
    a shared arena (None: unbounded, e.g. one request's own tokens)."""

    def __init__(self, anchors: Sequence[int], max_tokens: int | None = None,
                 max_sequences: int | None = None, track_new: bool = False) -> None:
        if not anchors or min(anchors) < 1:
            raise ValueError(f"anchors must be gram lengths >= 1, got {list(anchors)}")
        self.anchors = tuple(sorted(set(anchors), reverse=True))  # longest first
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.tokens: list[int] = []
        self.base = 0  # absolute position of tokens[0]
        self.start = 0  # first live position
        self.indexed = 0  # grams ending below this position are in the chains
        self.heads: dict[int, dict[int, int]] = {n: {} for n in self.anchors}
        self.prevs: dict[int, array[int]] = {n: array("q") for n in self.anchors}
        self.sequences: deque[tuple[int, int]] = deque()  # (first, end) incl. its SEP
        # track_new: the keys of longest-anchor grams indexed for the first time here, until
        # the owner takes them (a request publishing its grams to the other live requests)
        self.new_keys: list[int] | None = [] if track_new else None

    @property
    def end(self) -> int:
        """One past the newest position."""
        return self.base + len(self.tokens)

    @property
    def num_live_tokens(self) -> int:
        return self.end - self.start

    @property
    def pending(self) -> int:
        """Tokens appended and not indexed yet."""
        return self.end - self.indexed

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the open (last) sequence, unindexed: `index()` indexes them in
        bulk when the owner has time (and should before `MAX_PENDING` wait: every search
        scans them)."""
        self.tokens += token_ids

    def add_sequence(self, token_ids: Sequence[int]) -> None:
        """Store one whole sequence (closed by SEP), index it, then evict the oldest
        sequences while a bound is exceeded (never the one just added, which alone may be
        larger than `max_tokens`: then it is cut to its last `max_tokens`)."""
        if self.max_tokens is not None and len(token_ids) >= self.max_tokens:
            token_ids = token_ids[len(token_ids) - self.max_tokens + 1:]
        first = self.end
        self.tokens += token_ids
        self.tokens.append(SEP)
        self.sequences.append((first, self.end))
        self.index()
        self._evict()

    def index(self) -> None:
        """Put every gram that ends at or before the newest position into the chains."""
        end = self.end
        for n in self.anchors:
            prevs = self.prevs[n]
            lo = max(self.indexed, self.base + n - 1)  # the first end of a whole gram
            pad = min(lo, end) - self.base - len(prevs)
            if pad > 0:  # positions without a whole gram before them
                prevs.extend([-1] * pad)
            if lo < end:
                self._link(n, lo, end)
        self.indexed = end

    def _link(self, n: int, lo: int, end: int) -> None:
        keys = gram_keys(self.tokens[lo - n + 1 - self.base:end - self.base], n)
        heads, get = self.heads[n], self.heads[n].get
        prev = [0] * len(keys)
        for i, key in enumerate(keys):
            prev[i] = get(key, -1)
            heads[key] = lo + i
        self.prevs[n].extend(prev)
        if self.new_keys is not None and n == self.anchors[0]:  # never evicts: -1 is new
            self.new_keys += [key for key, p in zip(keys, prev, strict=True) if p < 0]

    def occurrences(self, n: int, key: int, limit: int) -> Iterator[int]:
        """Up to `limit` live end positions of indexed grams of length n with `key`, newest
        first."""
        pos, start, prevs, base = self.heads[n].get(key, -1), self.start, self.prevs[n], self.base
        while pos >= start and limit > 0:
            yield pos
            limit -= 1
            pos = prevs[pos - base]

    def find(self, n: int, pattern: list[int], cap: int, limit: int,
             seen: set[int]) -> list[tuple[int, int]]:
        """Up to `limit` indexed occurrences of `pattern`'s last n tokens, newest first, as
        (match length n .. cap, end position); those in `seen` are skipped, the others added
        to it."""
        pos = self.heads[n].get(pattern[-1] if n == 1 else hash(tuple(pattern[-n:])), -1)
        start = self.start
        if pos < start:
            return []  # the usual answer for new text: one dict miss
        found: list[tuple[int, int]] = []
        tokens, base, prevs = self.tokens, self.base, self.prevs[n]
        tail = pattern[-cap:]
        while pos >= start and limit > 0:
            if pos not in seen:
                e = pos + 1 - base
                if pos - start + 1 >= cap and tokens[e - cap:e] == tail:
                    length = cap  # the usual long match: one slice compare
                else:
                    length = self.match_len(pos, pattern, cap)
                if length >= n:  # else a key collision, or it crosses a sequence start
                    seen.add(pos)
                    found.append((length, pos))
            limit -= 1
            pos = prevs[pos - base]
        return found

    def longest(self, n: int, pattern: list[int], cap: int, limit: int, below: int,
                beat: int) -> tuple[int, int, int]:
        """The longest (of equals, the newest) of up to `limit` indexed occurrences of
        `pattern`'s last n tokens that end before `below`, that something follows and that
        match more than `beat` tokens (at most cap): (length, end position, what is left of
        `limit`), or (beat, -1, left). One slice compare rejects a candidate that cannot beat
        the best so far."""
        pos = self.heads[n].get(pattern[-1] if n == 1 else hash(tuple(pattern[-n:])), -1)
        start = self.start
        best, best_pos = beat, -1
        tokens, base, prevs = self.tokens, self.base, self.prevs[n]
        while pos >= start and limit > 0 and best < cap:
            e, need = pos + 1 - base, best + 1
            if (pos < below and pos - start >= best and tokens[e - need:e] == pattern[-need:]
                    and e < len(tokens) and tokens[e] != SEP):
                best, best_pos = self.match_len(pos, pattern, cap, need), pos
            limit -= 1
            pos = prevs[pos - base]
        return best, best_pos, limit

    def find_unindexed(self, pattern: list[int], cap: int, limit: int,
                       seen: set[int]) -> list[tuple[int, int]]:
        """`find` among the positions not indexed yet (scanned; the newest `limit` of the
        last token's occurrences), for any match length >= 1."""
        lo = max(self.indexed, self.start) - self.base
        segment = self.tokens[lo:]
        token = pattern[-1]
        if token not in segment:  # one scan in C: the usual answer
            return []
        hits, i = [], -1
        for _ in range(segment.count(token)):
            i = segment.index(token, i + 1)
            hits.append(lo + i + self.base)
        found: list[tuple[int, int]] = []
        for pos in hits[:-limit - 1:-1]:  # newest first
            if pos not in seen:
                seen.add(pos)
                found.append((self.match_len(pos, pattern, cap), pos))
        return found

    def match_len(self, pos: int, pattern: list[int], cap: int, known: int = 0) -> int:
        """The longest l <= cap with the l tokens ending at `pos` equal to `pattern[-l:]`
        (`known` of them are known to match)."""
        lo, hi = known, min(cap, len(pattern), pos - self.start + 1)
        tokens, end = self.tokens, pos - self.base + 1
        if hi > 0 and tokens[end - hi:end] == pattern[-hi:]:
            return hi
        hi -= 1  # lo matches, hi + 1 does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens[end - mid:end] == pattern[-mid:]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def continuation(self, pos: int, k: int) -> list[int]:
        """Up to k tokens after position `pos`, stopping at the end of its sequence."""
        i = pos + 1 - self.base
        out = self.tokens[i:i + k]
        if SEP in out:
            del out[out.index(SEP):]
        return out

    def token_at(self, pos: int) -> int:
        """The token at a live position, or SEP past the end or before `start`."""
        if pos < self.start or pos >= self.end:
            return SEP
        return self.tokens[pos - self.base]

    def _evict(self) -> None:
        seqs = self.sequences
        while len(seqs) > 1 and (
                (self.max_tokens is not None and self.num_live_tokens > self.max_tokens)
                or (self.max_sequences is not None and len(seqs) > self.max_sequences)):
            self.start = seqs.popleft()[1]
        dead = self.start - self.base
        if dead > 1024 and dead > self.num_live_tokens:
            self._compact()

    def _compact(self) -> None:
        dead = self.start - self.base
        del self.tokens[:dead]
        for n in self.anchors:
            del self.prevs[n][:dead]
            live = {k: p for k, p in self.heads[n].items() if p >= self.start}
            self.heads[n] = live
        self.base = self.start

    def check_integrity(self) -> None:
        """Raise AssertionError when a chain or a bound is broken (tests; slow)."""
        assert self.base <= self.start <= self.indexed <= self.end
        if self.max_tokens is not None and len(self.sequences) > 1:
            assert self.num_live_tokens <= self.max_tokens, "token bound exceeded"
        if self.max_sequences is not None:
            assert len(self.sequences) <= max(self.max_sequences, 1), "sequence bound exceeded"
        assert self.tokens.count(SEP) >= len(self.sequences)
        if self.new_keys is not None:
            assert len(set(self.new_keys)) == len(self.new_keys), "a key new twice"
            assert self.heads[self.anchors[0]].keys() >= set(self.new_keys)
        for n in self.anchors:
            assert len(self.prevs[n]) == self.indexed - self.base
            for key, head in self.heads[n].items():
                for pos in self.occurrences(n, key, 1 << 30):
                    gram = self.tokens[pos - n + 1 - self.base:pos + 1 - self.base]
                    assert len(gram) == n and gram_key(gram) == key, (n, key, pos)
                    assert pos <= head
