"""`scripts/bench_step.py --compare-host-tier` with tiny shapes: each side is stepped as the
engine steps it, the "on" side with the real host tier and its prompts backed up, and any host
traffic while the steps are timed fails the run."""

from __future__ import annotations

import re

import pytest

from scripts.host_tier_lib.step_compare import EngineSide, measure_host_tier, print_host_tier


def test_the_on_side_has_the_host_tier_and_the_off_side_none() -> None:
    off, on = EngineSide(False, 2, 64), EngineSide(True, 2, 64)
    assert off.host_tier is None and off.tree.host is None
    assert on.host_tier is not None and on.books.host_tier is on.host_tier
    assert on.traffic[0] > 0  # the default policy wrote the prompts through (not timed)
    for i in range(4):
        assert off.step(float(i)) >= 0.0 and on.step(float(i)) >= 0.0
    off.close()
    on.close()


def test_host_traffic_while_timed_fails_the_run() -> None:
    side = EngineSide(True, 2, 64)
    side.step(0.0)
    side.tree.host_stats.written_pages_total += 1  # as a write while timed would count
    with pytest.raises(SystemExit, match="host traffic"):
        side.close()


def test_the_lines_and_the_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    off, on, ratio = measure_host_tier(1, 64, 3, 1)
    assert off > 0 and on > 0 and ratio == pytest.approx(on / off)
    print_host_tier([1], [64], 3, 1)
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"host tier \(radix on, fake 2 ms, overlap\), bs 1 x 64: host off "
                        r"\d+\.\d{3} ms, on without traffic \d+\.\d{3} ms \(x\d\.\d{3}, median "
                        r"of 1 pairs\)", out[0]), out[0]
    assert re.fullmatch(r"bench_step host tier: worst no-traffic ratio \d\.\d{3} "
                        r"\(goal <= 1\.03\)", out[-1]), out[-1]
