"""The Triton paged decode attention compiled on CUDA equals the torch path (needs CUDA;
auto-skipped): the interpreter cases of tests/unit/device/test_decode_attention_triton.py (same
tolerances, stated there) plus gpt-oss's shape at long context and the runner's split counts.

Run on a GPU machine: `python -m pytest -q tests/gpu -x`.
"""

from __future__ import annotations

import random

import pytest
import torch

from decode_worker.device.attention_triton import TritonDecodeAttention
from tests.unit.device.test_decode_attention_triton import (
    COMBOS,
    TOL,
    WINDOW,
    check,
    edge_positions,
    make_case,
    torch_reference,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("page_size", "dtype", "kv_heads", "group"), COMBOS)
def test_interpreter_cases_match_torch_on_cuda(page_size: int, dtype: torch.dtype,
                                               kv_heads: int, group: int) -> None:
    for i, positions in enumerate(edge_positions(page_size)):
        check(make_case(positions, page_size, kv_heads, group, dtype, "cuda", seed=i), 1 + i)
    rng = random.Random(page_size)
    for bs in range(1, 10):
        positions = [rng.randint(0, 2000) for _ in range(bs)]
        check(make_case(positions, page_size, kv_heads, group, dtype, "cuda", seed=bs,
                        num_pages=256), splits=rng.choice((1, 2, 5, 16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 8, 64])
def test_gpt_oss_shape_with_the_runners_split_count(dtype: torch.dtype, bs: int) -> None:
    """8 KV heads x 8 query heads of 64, page 64, contexts to 8k, splits as the runner picks."""
    rng = random.Random(bs)
    positions = [rng.choice((0, 63, 64, 127, 128, 4100, 8191)) for _ in range(bs)]
    case = make_case(positions, 64, 8, 8, dtype, "cuda", num_pages=512)
    ref, _ = torch_reference(case)
    attn = TritonDecodeAttention(case.pools, WINDOW, case.positions, case.full, case.swa,
                                 max_keys=131072)
    atol, rtol = TOL[dtype]
    for layer in (0, 1):
        got = attn(layer, case.q, case.k, case.v, case.sinks)  # [bs, 64 * 64]
        torch.testing.assert_close(got.float(), ref[layer].float(), atol=atol, rtol=rtol)
