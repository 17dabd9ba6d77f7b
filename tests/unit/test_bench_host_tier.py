"""scripts/bench_host_tier.py with tiny shapes: the contract line, the host tier beating the
device-only pool, every restore bit-exact (the bench checks), and both ways of running it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_host_tier import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--chats", "12", "--turns", "3", "--system-len", "32", "--user-len", "16", "48",
        "--answer-len", "8", "24", "--concurrency", "2", "--page-size", "4", "--window", "15",
        "--check-every", "7"]
LAST = re.compile(r"bench_host_tier: unbounded_hit=(\d\.\d{3}) device_only_hit=(\d\.\d{3}) "
                  r"host_tier_hit=(\d\.\d{3}) kv_bytes_saved=(-?\d+\.\d)% "
                  r"restore_gbps=(\d+\.\d{2})")


def test_the_host_tier_keeps_the_reuse_the_device_pool_loses(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(TINY) == 0
    out = capsys.readouterr().out.splitlines()
    m = LAST.fullmatch(out[-1])
    assert m, out[-1]
    unbounded, device_only, host_tier, saved, gbps = map(float, m.groups())
    assert host_tier > device_only
    assert host_tier >= 0.95 * unbounded
    assert saved > 0 and gbps > 0
    assert any(line.startswith("best write policy: ") for line in out)
    rows = [line for line in out if line.startswith("host tier (")]
    assert len(rows) == 3  # one per write policy


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--turns", "1"])
    assert exc.value.code == 2
    assert "bench_host_tier" in capsys.readouterr().err


@pytest.mark.parametrize("how", [["scripts/bench_host_tier.py"], ["-m", "scripts.bench_host_tier"]])
def test_runs_as_a_script_and_as_a_module(how: list[str]) -> None:
    out = subprocess.run([sys.executable, *how, "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "--device-ratio" in out.stdout and "--policies" in out.stdout
