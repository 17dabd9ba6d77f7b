"""The fused MoE's kernels compile for Hopper (sm_90) at the launches `fused_moe` makes for
decode and prefill sizes: the interpreter tests cannot see a compiler failure, and no GPU is
needed to compile (scripts/compile_moe_kernels.py uses triton's bundled ptxas)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
                    .exists(), reason="this triton has no bundled ptxas")
def test_moe_kernels_compile_for_sm90_at_decode_and_prefill_sizes() -> None:
    done = subprocess.run([sys.executable, "scripts/compile_moe_kernels.py",
                           "--tokens", "1,256,4096"], cwd=REPO, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compile_moe_kernels: 0 failed" in done.stdout
    assert done.stdout.count("gate_up_kernel") == 4  # 3 MXFP4 sizes + dense float32
