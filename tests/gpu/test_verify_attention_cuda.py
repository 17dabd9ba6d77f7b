"""The grouped (verify) decode attention kernel compiled on CUDA equals the torch path and the
single-query kernel (needs CUDA; auto-skipped): the interpreter's cases of
tests/unit/device/test_verify_attention_triton.py at longer contexts, and gpt-oss's shape.

Run on a GPU machine: `python -m pytest -q tests/gpu -x`.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.unit.device.test_verify_attention_triton import (
    COMBOS,
    K_MAX,
    check,
    make_step,
    random_requests,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("page_size", "dtype", "kv_heads", "group", "head_dim"), COMBOS)
def test_random_groups_match_on_cuda(page_size: int, dtype: torch.dtype, kv_heads: int,
                                     group: int, head_dim: int) -> None:
    rng = random.Random(page_size + head_dim)
    for i in range(8):
        window = rng.choice((127, 200, 1000))
        step = make_step(random_requests(rng, page_size, 3000, window), page_size, kv_heads,
                         group, dtype, head_dim, window, seed=i, num_pages=1024, device="cuda")
        check(step, splits=rng.choice((1, 2, 5, 16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_shape_with_k_up_to_8_and_a_4096_window(dtype: torch.dtype) -> None:
    """8 KV heads x 8 query heads of 64 (16 queries a program in bf16, 8 in float32)."""
    requests = [(p, k) for p, k in ((0, K_MAX), (63, 1), (127, 4), (4100, K_MAX), (8000, 2))]
    check(make_step(requests, 64, 8, 8, dtype, num_pages=1024, device="cuda"), splits=8)
    check(make_step([(4096 + 60, K_MAX), (6000, 3)], 64, 8, 8, dtype, window=4096,
                    num_pages=1024, device="cuda"), splits=4)
