"""Processes sharing one CUDA card, each sized by its own share (`device/gpu_memory.py`),
on a fake card behind the `DeviceMemory` seam (no CUDA needed)."""

from __future__ import annotations

import pytest

from decode_worker.core.memory_budget import (
    CONTEXT_BYTES,
    GIB,
    MemoryBudget,
    MemoryBudgetError,
    colocated_share,
)
from decode_worker.device.gpu_memory import ShareTracker
from tests.fakes.fake_memory import FakeCard, FakeOutOfMemory, FakeProcessMemory

CARD = 140 * GIB
DEFAULT_FRACTION = 0.85  # cache.memory_fraction's default


def start(proc: FakeProcessMemory, fraction: float) -> ShareTracker:
    """A process's first contact: the start-up check only."""
    return ShareTracker.start(proc, fraction)


def size(proc: FakeProcessMemory, share: ShareTracker, weights: int, graphs: int,
         peak: int) -> MemoryBudget:
    """What build_runtime does after the check: weights, the graph probe (captured over probe
    pools, then freed), the eager probe (a peak, freed), then the pools and the real graphs."""
    proc.alloc(weights)
    share.weights_loaded()

    def capture():  # type: ignore[no-untyped-def]
        proc.alloc(graphs)
        return lambda: proc.free(graphs)

    assert share.measure_graphs(capture) == graphs

    def probe() -> None:
        proc.alloc(peak)
        proc.free(peak)

    assert share.measure_headroom(probe) == peak
    budget = share.budget()
    proc.alloc(budget.pool_bytes)
    proc.alloc(graphs)
    return budget


def test_two_processes_with_their_default_shares_both_fit_on_one_card() -> None:
    card = FakeCard(CARD)
    fraction = colocated_share(2)  # what the demo and the tests give each of two processes
    procs = [card.process(), card.process()]
    shares = [start(p, fraction) for p in procs]  # both check before either allocates
    budgets = [size(p, s, 13 * GIB, 2 * GIB, 3 * GIB) for p, s in zip(procs, shares,
                                                                          strict=True)]
    assert budgets[0].pool_bytes == budgets[1].pool_bytes > 40 * GIB  # start order is moot
    for proc, budget in zip(procs, budgets, strict=True):
        # the share covers everything held plus the headroom the process may still use
        assert proc.held + CONTEXT_BYTES + budget.headroom_bytes <= budget.share_bytes
    assert card.used_bytes + 2 * 3 * GIB <= CARD  # both at their activation peak still fit
    line = budgets[0].describe()
    for part in ("cache.memory_fraction=0.425", "weights 13.50 GiB", "graphs 2.00 GiB",
                 "headroom 3.00 GiB", "pools"):
        assert part in line


def test_a_share_the_card_cannot_give_is_a_start_error_before_any_allocation() -> None:
    card = FakeCard(CARD)
    first = card.process()
    size(first, start(first, DEFAULT_FRACTION), 13 * GIB, 2 * GIB, 3 * GIB)
    second = card.process()
    with pytest.raises(MemoryBudgetError) as err:
        start(second, DEFAULT_FRACTION)
    msg = str(err.value)
    assert "cache.memory_fraction=0.85 asks for 119.00 GiB" in msg
    assert "set cache.memory_fraction to at most 0.1" in msg
    assert second.held == 0  # nothing large was allocated
    # the fraction the message names does start
    fits = float(msg.split("at most ")[1].split(" ")[0])
    size(second, start(second, fits), 1 * GIB, 0, GIB // 2)


def test_what_the_old_sizing_did_runs_out_of_memory_where_the_share_does_not() -> None:
    """The old rule (pools = fraction * total - used at the process's own start) gave the
    second process a budget from what the first left: it hit an OOM at its pools."""
    card = FakeCard(CARD)
    first = card.process()
    first.alloc(int(DEFAULT_FRACTION * CARD))  # the first took 85 % of the card
    second = card.process()
    second.alloc(13 * GIB)
    free, total = second.mem_get_info()
    old_budget = max(0, int(total * DEFAULT_FRACTION) - (total - free))
    with pytest.raises(FakeOutOfMemory):
        second.alloc(old_budget + 13 * GIB)  # what the old rule would have let it try


def test_weights_larger_than_the_share_leave_no_pools_and_say_so() -> None:
    card = FakeCard(CARD)
    proc = card.process()
    share = start(proc, 0.1)
    with pytest.raises(MemoryBudgetError, match="weights hold 13.50 GiB.*raise "
                                                "cache.memory_fraction"):
        size(proc, share, 13 * GIB, GIB, GIB)


def test_graph_memory_is_what_the_capture_left_reserved_and_all_of_it_goes_back() -> None:
    """A graph's private pool keeps the scratch its capture freed (replays reuse those
    addresses), so the reserve is the reserved growth, not the live tensors at the end."""
    card = FakeCard(CARD)
    proc = card.process()
    share = start(proc, 0.5)
    proc.alloc(GIB)
    share.weights_loaded()

    def capture():  # type: ignore[no-untyped-def]
        proc.alloc(3 * GIB)  # scratch during capture, freed before it ends
        proc.free(3 * GIB)
        proc.alloc(GIB)  # the static output (reuses cached scratch)
        return lambda: proc.free(GIB)

    assert share.measure_graphs(capture) == 3 * GIB
    assert proc.held == GIB  # the probe's memory went back to the card
