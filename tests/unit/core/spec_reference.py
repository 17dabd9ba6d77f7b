"""Brute-force drafters for the property tests: every occurrence in the memory looked at, no
index, no budget (what core/spec/ngram.py and suffix.py compute with unbounded search
budgets), plus helpers to read a drafter's memories."""

from __future__ import annotations

from decode_worker.core.spec.arena import SEP, TokenArena
from decode_worker.core.spec.ngram import NgramDrafter

Seq = list[int]


def live_sequences(arena: TokenArena | None) -> list[Seq]:
    """The sequences a shared arena holds now, oldest first (without their SEP)."""
    if arena is None:
        return []
    out = []
    for first, end in arena.sequences:
        if first >= arena.start:
            out.append(arena.tokens[first - arena.base:end - 1 - arena.base])
    return out


def live_others(drafter: NgramDrafter, rid: str) -> list[tuple[Seq, int]]:
    """The other live requests' tokens and how many of them the others see (`shown`),
    newest started first."""
    others = [r for key, r in drafter._reqs.items() if key != rid]
    return [(list(r.own.tokens), r.shown) for r in sorted(others, key=lambda r: -r.seq)]


def match_len(seq: Seq, i: int, pattern: Seq, cap: int) -> int:
    """How many tokens ending at seq[i] equal the end of `pattern` (at most cap)."""
    n = 0
    while n < cap and n <= i and n < len(pattern) and seq[i - n] == pattern[-1 - n]:
        n += 1
    return n


def ngram(own: Seq, shared: list[Seq], k: int, lo: int, hi: int,
          live: list[tuple[Seq, int]] | None = None, live_min: int = 1) -> Seq:
    """The longest suffix match (lo..hi) with something after it; own tokens, then the live
    requests (`live`: tokens and shown count, newest started first; a match there ends
    below its shown count and is at least `live_min` long), then the newest, win ties. A
    match in `own` whose continuation reaches its end repeats with that period."""
    pattern = own[-hi:]
    best: tuple[int, int, int] = (0, 0, 0)  # (length, source rank, position rank)
    draft: Seq = []
    live = live or []
    memories = [(own, 1 << 40, len(own), lo)]
    memories += [(seq, (1 << 30) + len(live) - j, shown, max(lo, live_min))
                 for j, (seq, shown) in enumerate(live)]
    memories += [(seq, j, len(seq), lo) for j, seq in enumerate(shared)]
    for seq, rank, below, least in memories:
        for i in range(min(below, len(seq) - 1)):
            length = match_len(seq, i, pattern, hi)
            key = (length, rank, i)
            if length >= least and key > best:
                best, draft = key, seq[i + 1:i + 1 + k]
                if seq is own:
                    period = len(own) - 1 - i
                    draft = [own[i + 1 + j % period] for j in range(k)]
    return draft


def suffix(own: Seq, shared: list[Seq], k: int, depth: int, factor: float,
           min_prob: float) -> Seq:
    """Arctic's `speculate` (chain) over every occurrence, the request's own last position
    not one; the own memory wins ties."""
    pattern = own[-depth:]
    max_m = min(depth, len(pattern)) - 1
    local = _best([own[:]], pattern, max_m, k, depth, factor, min_prob, own_tail=True)
    glob = _best(shared, pattern, max_m, k, depth, factor, min_prob, own_tail=False)
    return glob[1] if glob[0] > local[0] else local[1]


def _best(seqs: list[Seq], pattern: Seq, max_m: int, k: int, depth: int, factor: float,
          min_prob: float, own_tail: bool) -> tuple[float, Seq]:
    occ = []  # (match length, sequence, position), newest first
    for j in range(len(seqs) - 1, -1, -1):
        seq = seqs[j]
        last = len(seq) - 1 if own_tail else len(seq)
        for i in range(last - 1, -1, -1):
            occ.append((match_len(seq, i, pattern, max_m), j, i))
    best: tuple[float, Seq] = (0.0, [])
    for m in range(max_m, 0, -1):  # a tie keeps the longer match
        room = min(k, int(m * factor + 1e-6), depth - m)
        ends = [(j, i) for length, j, i in occ if length >= m]
        score, draft = _walk(seqs, ends, room, min_prob)
        if score > best[0]:
            best = (score, draft)
    return best


def _walk(seqs: list[Seq], ends: list[tuple[int, int]], room: int,
          min_prob: float) -> tuple[float, Seq]:
    prob, score, out = 1.0, 0.0, []
    while len(out) < room and ends:
        counts: dict[int, int] = {}
        for j, i in ends:  # newest first: the first of equally common ones wins
            if i + 1 < len(seqs[j]):
                counts[seqs[j][i + 1]] = counts.get(seqs[j][i + 1], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)
        prob *= counts[token] / len(ends)
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        ends = [(j, i + 1) for j, i in ends if i + 1 < len(seqs[j]) and seqs[j][i + 1] == token]
    return score, out


def occurs_after_match(draft: Seq, context: Seq, memories: list[Seq], min_len: int) -> bool:
    """Whether `draft` follows, in one of `memories`, an occurrence of the last `min_len`
    tokens of `context` (the request's own last position excluded; in `context` itself the
    continuation repeats with its period once it reaches the end)."""
    tail = context[-min_len:]
    for seq in memories:
        for i in range(len(seq) - 1):
            after = seq[i + 1:i + 1 + len(draft)]
            if seq is context:
                period = len(seq) - 1 - i
                after = [seq[i + 1 + j % period] for j in range(len(draft))]
            if (i + 1 >= min_len and seq[i + 1 - min_len:i + 1] == tail
                    and after == draft and SEP not in draft):
                return True
    return False
