"""A process's share of a card (core/memory_budget.py): pure arithmetic, property-tested."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decode_worker.core.memory_budget import (
    CONTEXT_BYTES,
    GIB,
    MemoryBudgetError,
    check_share_free,
    colocated_share,
    plan_budget,
)

CARD = 141 * GIB


@given(st.lists(st.tuples(st.floats(0.05, 0.5), st.integers(0, 8 * GIB),
                          st.integers(0, 4 * GIB), st.integers(0, 4 * GIB)),
                min_size=1, max_size=6))
def test_processes_whose_shares_add_up_to_at_most_one_all_start_and_fit(procs) -> None:  # type: ignore[no-untyped-def]
    procs = [p for p in procs if p[0] * CARD > p[1] + p[2] + p[3] + CONTEXT_BYTES]
    total_fraction = sum(p[0] for p in procs)
    scale = min(1.0, 0.999 / total_fraction) if procs else 1.0
    used = 0
    for fraction, weights, graphs, headroom in procs:
        fraction *= scale
        if fraction * CARD <= weights + graphs + headroom + CONTEXT_BYTES:
            continue
        check_share_free(fraction, CARD, CARD - used - CONTEXT_BYTES)  # no error
        budget = plan_budget(fraction, CARD, weights + CONTEXT_BYTES, graphs, headroom)
        spent = budget.weights_bytes + budget.graph_bytes + budget.headroom_bytes
        assert spent + budget.pool_bytes == budget.share_bytes
        used += budget.share_bytes
        assert used <= CARD


@given(st.floats(0.01, 1.0), st.integers(0, CARD), st.integers(0, 2 * GIB))
def test_the_start_check_refuses_exactly_when_the_free_memory_is_short(
        fraction: float, free: int, held: int) -> None:
    short = free < int(fraction * CARD) - held
    try:
        check_share_free(fraction, CARD, free, held)
    except MemoryBudgetError as exc:
        assert short
        if "at most " in str(exc):
            fits = float(str(exc).split("at most ")[1].split(" ")[0])
            check_share_free(fits, CARD, free, held)  # the fraction it names does start
        else:
            assert free + held < CARD // 100
    else:
        assert not short


def test_nothing_left_for_the_pools_names_every_figure() -> None:
    with pytest.raises(MemoryBudgetError) as err:
        plan_budget(0.1, CARD, 13 * GIB, 2 * GIB, GIB)
    assert str(err.value) == (
        "KV pools do not fit: cache.memory_fraction=0.1 gives 14.10 GiB, of which the weights "
        "hold 13.00 GiB, CUDA graphs 2.00 GiB and the activation headroom 1.00 GiB; raise "
        "cache.memory_fraction")


def test_colocated_shares_split_the_card_fraction_and_never_round_up() -> None:
    assert colocated_share(1) == 0.85
    assert colocated_share(3) == 0.283
    assert all(n * colocated_share(n) <= 0.85 for n in range(1, 9))
    with pytest.raises(ValueError):
        colocated_share(0)
