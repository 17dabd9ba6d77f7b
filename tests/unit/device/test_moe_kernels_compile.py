"""The fused MoE's kernels compile for Hopper (sm_90) at the launches `fused_moe` makes for
decode and prefill sizes: the interpreter tests cannot see a compiler failure, and no GPU is
needed to compile (scripts/compile_moe_kernels.py uses triton's bundled ptxas)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.unit.device.conftest import Runs

triton = pytest.importorskip("triton")


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
                    .exists(), reason="this triton has no bundled ptxas")
def test_moe_kernels_compile_for_sm90_at_decode_and_prefill_sizes(sm90_compiles: Runs) -> None:
    """`scripts/compile_moe_kernels.py --tokens 1,256,4096`, run in the background since the
    first device test (tests/unit/device/conftest.py)."""
    done = sm90_compiles["moe"].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compile_moe_kernels: 0 failed" in done.stdout
    # 3 MXFP4 sizes + dense float32 + Qwen3-30B-A3B's SiLU experts at 1 and 256 tokens
    assert done.stdout.count("gate_up_kernel") == 6
    assert done.stdout.count("qwen3-silu torch.bfloat16 gate_up_kernel") == 2
