"""TokenArena: hash chains find every occurrence newest first, bounded arenas evict the
oldest sequences and compact, and nothing crosses a sequence boundary."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.core.spec.arena import SEP, TokenArena
from tests.examples import examples
from tests.unit.core import spec_reference as ref


@settings(max_examples=examples(200), deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1,
                     max_size=6),
       pattern=st.lists(st.integers(0, 3), min_size=1, max_size=8), n=st.integers(1, 4),
       max_tokens=st.one_of(st.none(), st.integers(1, 60)))
def test_find_lists_every_live_occurrence_newest_first(
        seqs: list[list[int]], pattern: list[int], n: int, max_tokens: int | None) -> None:
    arena = TokenArena((n, 1), max_tokens=max_tokens)
    for seq in seqs:
        arena.add_sequence(seq)
    arena.check_integrity()
    if n > len(pattern):
        return
    found = arena.find(n, pattern, 8, 1 << 20, set())
    expected = []
    live = ref.live_sequences(arena)
    offsets = [first for first, _ in arena.sequences if first >= arena.start]
    for seq, first in zip(live, offsets, strict=True):
        for i in range(len(seq)):
            length = ref.match_len(seq, i, pattern, 8)
            if length >= n:
                expected.append((length, first + i))
    assert found == sorted(expected, key=lambda f: -f[1])


def test_eviction_keeps_the_newest_within_bounds_and_compacts() -> None:
    arena = TokenArena((5, 1), max_tokens=100)
    for i in range(300):
        arena.add_sequence([i % 7, 1000 + i, 2, 3, 4, 5, 6, 7, 8])
    assert arena.num_live_tokens <= 100
    assert len(arena.tokens) <= 2 * 100 + 1024  # the dead prefix is cut off
    # stale heads go with the prefix they point into: the index stays as small as the arena
    assert all(p >= arena.base for h in arena.heads.values() for p in h.values())
    assert all(len(h) <= len(arena.tokens) for h in arena.heads.values())
    arena.check_integrity()
    newest = arena.find(1, [1299], 4, 10, set())
    assert newest == [(1, arena.sequences[-1][0] + 1)]
    assert arena.find(1, [1000], 4, 10, set()) == []  # evicted long ago
    assert arena.continuation(arena.sequences[-1][0], 20) == [1299, 2, 3, 4, 5, 6, 7, 8]


def test_sequence_bound_and_a_sequence_longer_than_the_arena() -> None:
    arena = TokenArena((1,), max_tokens=10, max_sequences=2)
    for seq in ([1, 2], [3, 4], [5, 6]):
        arena.add_sequence(seq)
    assert ref.live_sequences(arena) == [[3, 4], [5, 6]]
    arena.add_sequence(list(range(20, 40)))  # alone over the bound: its last 9 kept
    assert ref.live_sequences(arena) == [list(range(31, 40))]
    arena.check_integrity()


def test_matches_and_continuations_stop_at_sequence_boundaries() -> None:
    arena = TokenArena((2, 1))
    arena.add_sequence([1, 2, 3])
    arena.add_sequence([4, 1, 2])
    assert arena.continuation(arena.sequences[1][0] + 2, 5) == []  # its end: nothing after
    assert arena.find(2, [3, 4, 1, 2], 4, 10, set()) == [(3, 6), (2, 1)]  # "4 1 2" and "1 2"
    assert SEP not in arena.continuation(1, 10)


def test_unindexed_tokens_are_found_by_the_scan() -> None:
    arena = TokenArena((5, 1))
    arena.extend([7, 8, 9, 7, 8])
    assert arena.pending == 5
    assert arena.find_unindexed([9, 7, 8], 3, 10, {4}) == [(2, 1)]
    arena.index()
    assert arena.pending == 0 and arena.find(1, [9, 7, 8], 3, 10, {4}) == [(2, 1)]
