"""The Triton paged decode attention at the new families' shapes equals the torch path, under
Triton's interpreter: head_dim 64, 128 and 256, windows up to 4096 (Gemma 3: HF 1024; others up
to 4096), no attention sinks (the -1e30 sink the shared decoder passes) and a softmax scale
other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar). Float32 pools: the two differ only
in summation order (tolerance 1e-5, as tests/unit/device/test_decode_attention_triton.py)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from decode_worker.device.attention import DecodeAttention
from decode_worker.device.attention_triton import TritonDecodeAttention
from decode_worker.device.decode_inputs import swa_ring_width
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.decoder import NO_SINK

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors need TRITON_INTERPRET=1; see tests/gpu")


@pytest.mark.parametrize(("head_dim", "window", "positions"), [
    (64, 127, [0, 200]),
    (128, 1023, [1022, 1023, 1100]),  # Gemma 3: the window's edge, then a wrapped ring
    (256, 4095, [4094, 4200]),  # Gemma 3 1B/4B's head_dim, the widest window
])
def test_family_shapes_without_sinks_match_the_torch_path(head_dim: int, window: int,
                                                          positions: list[int]) -> None:
    page, kvh, group = 64, 1, 2
    gen, rng = torch.Generator().manual_seed(head_dim), random.Random(head_dim)
    num_pages = max(positions) // page + swa_ring_width(window, page) + 4
    spec = KVSpec(("full_attention", "sliding_attention"), kvh, head_dim)
    pools = KVPools(spec, num_pages, num_pages, page, "cpu", torch.float32)
    for t in (pools.full, pools.swa):
        t.copy_(torch.randn(t.shape, generator=gen))
    bs, ring = len(positions), swa_ring_width(window, page)
    width = max(positions) // page + 2
    full = torch.tensor([rng.sample(range(1, num_pages + 1), width) for _ in positions])
    swa = torch.tensor([rng.sample(range(1, num_pages + 1), ring) for _ in positions])
    pos = torch.tensor(positions)
    q = torch.randn(bs, kvh * group, head_dim, generator=gen)  # [bs, heads, hd]
    k, v = (torch.randn(bs, kvh, head_dim, generator=gen) for _ in range(2))
    sinks = torch.full((kvh * group,), NO_SINK)  # [heads] f32
    scale = 168 ** -0.5  # Gemma-3-27B's query_pre_attn_scalar
    saved = (pools.full.clone(), pools.swa.clone())
    ref_attn = DecodeAttention(pools, window, pos, full, swa, scale)
    ref = [ref_attn(layer, q, k, v, sinks) for layer in (0, 1)]
    pools.full.copy_(saved[0])
    pools.swa.copy_(saved[1])
    attn = TritonDecodeAttention(pools, window, pos, full.int(), swa.int(),
                                 max_keys=width * page, scale=scale)
    for layer in (0, 1):
        out = attn(layer, q, k, v, sinks)  # [bs, heads * hd]
        torch.testing.assert_close(out, ref[layer], atol=1e-5, rtol=1e-5)
