"""`scripts/gpu_check.sh` on a machine without CUDA: every CUDA part is skipped, saying why,
and the run ends with its table, the host tier's line, the verify benchmark's line and the
benchmark's contract line (exit 0); `scripts/gpu_host_tier.py` skips cleanly on its own too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the script runs every part")
def test_gpu_check_skips_its_cuda_parts_cleanly_without_cuda(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_SITE": str(tmp_path / "site")}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "bench_gpu_decode: not run"
    assert lines[-2] == "bench_gpu_verify: not run"
    assert lines[-3] == "gpu_host_tier: not run"
    table = lines[lines.index("gpu_check: part       result   time") + 1:-3]
    assert [row.split()[:2] for row in table] == [
        ["imports", "pass"], ["tests/gpu", "skip"], ["e2e", "skip"], ["demo", "skip"],
        ["bench", "skip"], ["verify", "skip"], ["hosttier", "skip"]]
    assert out.stdout.count("skipped: no CUDA device") == 6
    for name in ("imports", "tests_gpu", "e2e", "demo", "bench", "verify", "hosttier"):
        assert (tmp_path / f"{name}.log").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the script measures")
@pytest.mark.parametrize("how", [["scripts/gpu_host_tier.py"], ["-m", "scripts.gpu_host_tier"]])
def test_gpu_host_tier_skips_cleanly_without_cuda(how: list[str]) -> None:
    out = subprocess.run([sys.executable, *how], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "gpu_host_tier: skipped: no CUDA device"
