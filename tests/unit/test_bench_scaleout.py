"""scripts/bench_scaleout.py without servers: its hit-rate arithmetic, a workload that is the
same on every run, the refusals before anything starts, and both ways of running it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decode_worker.daemon.shared.router import router_argv
from decode_worker.errors import DecodeWorkerError
from scripts.bench_scaleout import main
from scripts.scaleout_lib.workload import Turn, hit_rate, later_turn_hit, p50_ms, user_turns

ROOT = Path(__file__).resolve().parents[2]


def _turn(conversation: int, turn: int, prompt: int, cached: int) -> Turn:
    return Turn(conversation, turn, prompt, cached, 4, 0.1, None)


def test_later_turn_hit_weights_tokens_and_skips_first_turns() -> None:
    turns = [_turn(0, 0, 100, 0), _turn(0, 1, 200, 150), _turn(1, 0, 100, 90),
             _turn(1, 1, 300, 150), _turn(1, 2, 500, 400)]
    assert later_turn_hit(turns) == pytest.approx((150 + 150 + 400) / (200 + 300 + 500))
    assert hit_rate([t for t in turns if t.turn == 0]) == pytest.approx(90 / 200)
    assert later_turn_hit(turns[:1]) == 0.0
    assert p50_ms([0.1, None, 0.3, 0.2]) == pytest.approx(200.0)


def test_the_workload_is_the_same_on_every_run() -> None:
    a, b = user_turns(9, 4, seed=0), user_turns(9, 4, seed=0)
    assert a == b and len(a) == 9 and all(len(c) == 4 for c in a)
    assert user_turns(9, 4, seed=1) != a
    assert len({c[0] for c in a}) == 9  # every conversation asks its own first question


@pytest.mark.parametrize("argv", [["--workers", "1"], ["--turns", "1"],
                                  ["--policies", "cache_aware,fastest"]])
def test_bad_arguments_are_refused_before_anything_starts(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "bench_scaleout" in capsys.readouterr().err


@pytest.mark.parametrize("how", [["scripts/bench_scaleout.py"], ["-m", "scripts.bench_scaleout"]])
def test_runs_as_a_script_and_as_a_module(how: list[str]) -> None:
    out = subprocess.run([sys.executable, *how, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "--pool-pages" in out.stdout and "--workers" in out.stdout


def test_router_argv_lists_every_worker_and_refuses_unknown_names() -> None:
    argv = router_argv("smg", [("http://p:1", 8998)], ["http://d0:2", "http://d1:3"], 9000,
                       decode_policy="cache_aware")
    assert argv[1:3] == ["-m", "smg.launch_router"]
    assert argv.count("--decode") == 2 and argv[argv.index("--prefill") + 2] == "8998"
    assert argv[argv.index("--decode-policy") + 1] == "cache_aware"
    with pytest.raises(DecodeWorkerError, match="unknown router policy"):
        router_argv("smg", [], [], 1, policy="fastest")
    with pytest.raises(DecodeWorkerError, match="unknown router"):
        router_argv("nginx", [], [], 1)
