"""The fused Triton MoE (device/kernels/) against the torch MoE on the dequantized weights.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when no CUDA device is visible), on a CUDA machine compiled (tests/gpu/test_fused_moe_cuda.py
runs these tests there too). Shapes are small (hidden = intermediate = 64) because the
interpreter runs numpy per program.

Tolerances, float32 activations: MXFP4 decodes exactly (bit-equal test below), products are
IEEE float32, so kernel and reference differ only in summation order: 1e-5 of the output's
largest magnitude (seen: ~4e-7). bfloat16: the kernel rounds the SwiGLU output and the result to
bf16, the torch path rounds after every op; both are held to 2 % of the largest magnitude of the
float32 reference (a few bf16 ulps at that magnitude; seen ~1 %).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from decode_worker.device.default_model import tiny_config
from decode_worker.device.kernels.fused_moe import fused_moe
from decode_worker.device.kernels.moe_align import max_blocks, route_and_align
from decode_worker.device.kernels.mxfp4 import dequantize_tiles
from decode_worker.device.model import gpt_oss
from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.gpt_oss import LayerWeights
from decode_worker.device.model.synthetic import random_mxfp4_checkpoint
from decode_worker.device.model.weights import dequantize_mxfp4, from_state_dict
from decode_worker.errors import ConfigError

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LIMIT = 7.0  # gpt-oss's swiglu_limit (tiny_config's too)
# (T, E, k): every T in {1, 3, 17, 64}, E in {4, 8, 32}, k in {1, 2, 4} and every (E, k) pair,
# not the 36-case product (~50 s under the interpreter here); T * k above BM = 16 in 5 of them
CASES = [(1, 32, 4), (1, 4, 1), (3, 8, 2), (3, 4, 4), (17, 32, 1), (17, 4, 2), (17, 8, 4),
         (64, 8, 4), (64, 8, 1), (64, 32, 2)]


def layers(num_experts: int, top_k: int, dtype: torch.dtype, seed: int,
           router_bias: torch.Tensor | None = None) -> tuple[LayerWeights, LayerWeights,
                                                             GptOssConfig]:
    """One layer loaded twice from one random MXFP4 checkpoint: kept (Triton) and dequantized
    (torch, in `dtype`). Weights ~0.2-3 and biases ~N(0, 2), so the gate_up outputs fall inside
    and far outside [-limit, limit]."""
    cfg = GptOssConfig.from_dict(tiny_config(num_local_experts=num_experts,
                                             num_experts_per_tok=top_k, num_hidden_layers=1))
    state = random_mxfp4_checkpoint(cfg, DEVICE, dtype, seed, scale_range=(123, 127))
    for name in [n for n in state if n.endswith("_proj_bias")]:
        state[name] = state[name] * 100
    if router_bias is not None:
        state["model.layers.0.mlp.router.bias"] = router_bias.to(DEVICE, dtype)
    kept = from_state_dict(cfg, state, DEVICE, dtype, moe_backend="triton").layers[0]
    dense = from_state_dict(cfg, state, DEVICE, dtype, moe_backend="torch").layers[0]
    return kept, dense, cfg


def tokens(num_tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
    return x.to(DEVICE, dtype)  # [T, H]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), CASES)
def test_mxfp4_moe_matches_the_torch_moe_on_dequantized_weights(
        num_tokens: int, num_experts: int, top_k: int) -> None:
    kept, dense, cfg = layers(num_experts, top_k, torch.float32, seed=num_tokens + num_experts)
    assert kept.gate_up.dtype == torch.uint8 and kept.gate_up_scales is not None
    x = tokens(num_tokens)
    out = gpt_oss.moe(x, kept, cfg, static=True, backend="triton")  # [T, H]
    ref = gpt_oss.moe(x, dense, cfg, static=False)  # [T, H]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < 1e-5


def test_the_clamp_and_the_biases_are_exercised() -> None:
    """The pre-activations of the cases above reach past +-limit on both sides, and the bias
    moves them by whole units (so a kernel ignoring either would fail those tests)."""
    _, dense, _ = layers(8, 2, torch.float32, seed=3 + 8)  # the (3, 8, 2) case
    gu = torch.einsum("th,ehi->eti", tokens(3), dense.gate_up)  # [E, T, 2I] before bias
    with_bias = gu + dense.gate_up_b[:, None, :]
    gate, up = with_bias.chunk(2, dim=-1)
    assert (gate > LIMIT).float().mean() > 0.1 and (gate.abs() < LIMIT).float().mean() > 0.1
    assert (up < -LIMIT).float().mean() > 0.05 and (up > LIMIT).float().mean() > 0.05
    assert (with_bias - gu).abs().mean() > 1.0


@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_on_one_expert(top_k: int) -> None:
    """64 tokens on expert 5 (64 * k pairs: several blocks of one expert), the rest idle."""
    bias = torch.zeros(8)
    bias[5] = 100.0
    kept, dense, cfg = layers(8, top_k, torch.float32, seed=7, router_bias=bias)
    x = tokens(64)
    routing = route_and_align(torch.nn.functional.linear(x, kept.router_w, kept.router_b),
                              top_k, 16)
    assert (routing.topk_ids[:, 0] == 5).all()
    used = routing.expert_ids[routing.expert_ids >= 0]
    assert (used == 5).sum() == 4  # 64 pairs of expert 5 in blocks of 16
    out = gpt_oss.moe(x, kept, cfg, static=True, backend="triton")
    assert rel_err(out, gpt_oss.moe(x, dense, cfg, static=False)) < 1e-5


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"),
                         [(1, 32, 4, 16), (17, 8, 3, 16), (64, 4, 1, 16), (40, 128, 4, 32)])
def test_routing_sorts_every_pair_once_into_blocks_of_its_expert(
        num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    logits = torch.randn(num_tokens, num_experts,
                         generator=torch.Generator().manual_seed(num_experts)).to(DEVICE)
    r = route_and_align(logits, top_k, block_m)
    top_v, top_i = torch.topk(logits, top_k)
    assert torch.equal(r.topk_ids.long(), top_i)
    assert torch.allclose(r.topk_w, torch.softmax(top_v, dim=-1), atol=1e-6, rtol=0)
    pairs = num_tokens * top_k
    assert r.num_blocks == max_blocks(num_tokens, top_k, num_experts, block_m)
    counts = torch.bincount(top_i.flatten(), minlength=num_experts)
    used = int((r.expert_ids >= 0).sum())
    hit = set(torch.nonzero(counts).flatten().tolist())
    assert set(r.expert_ids[:used].tolist()) == hit  # idle experts get no block
    assert used == int(((counts + block_m - 1) // block_m).sum())
    assert (r.expert_ids[used:] == -1).all()
    rows = r.sorted_ids[:used * block_m].view(used, block_m).long()  # [blocks, BM]
    real = rows < pairs
    assert sorted(rows[real].tolist()) == list(range(pairs))  # each pair exactly once
    assert (rows[~real] == pairs).all()  # padding holds the sentinel
    owner = r.expert_ids[:used].long()[:, None].expand(-1, block_m)  # [blocks, BM]
    assert torch.equal(top_i.flatten()[rows[real]], owner[real])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_tiles_decode_mxfp4_bit_for_bit(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 3, 16), generator=gen, dtype=torch.uint8)
    low, high = (2, 253) if dtype != torch.float16 else (100, 141)  # fp16: no overflow to inf
    scales = torch.randint(low, high, (3, 40, 3), generator=gen, dtype=torch.uint8)
    scales[0, 0, :] = torch.tensor([low, high - 1, 127], dtype=torch.uint8)
    ours = dequantize_tiles(blocks.to(DEVICE), scales.to(DEVICE), dtype).cpu()
    ref = dequantize_mxfp4(blocks, scales, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert ours.shape == ref.shape == (3, 96, 40)
    assert torch.equal(ours.view(bits), ref.view(bits))  # -0.0 included


def test_dense_float32_experts_run_through_the_kernel() -> None:
    cfg = GptOssConfig.from_dict(tiny_config(num_local_experts=8, num_experts_per_tok=2,
                                             num_hidden_layers=1))
    state = random_mxfp4_checkpoint(cfg, DEVICE, torch.float32, 5, scale_range=(123, 127))
    dense = from_state_dict(cfg, state, DEVICE, torch.float32).layers[0]
    x = tokens(17)
    out = gpt_oss.moe(x, dense, cfg, static=True, backend="triton")  # dense weights, kernel
    assert rel_err(out, gpt_oss.moe(x, dense, cfg, static=False)) < 1e-5


def test_bfloat16_moe_is_as_close_to_float32_as_the_torch_path() -> None:
    kept, dense, cfg = layers(8, 2, torch.bfloat16, seed=17)
    _, dense32, _ = layers(8, 2, torch.float32, seed=17)
    x = tokens(17, torch.bfloat16)
    out = gpt_oss.moe(x, kept, cfg, static=True, backend="triton")
    assert out.dtype == torch.bfloat16
    ref = gpt_oss.moe(x.float(), dense32, cfg, static=False)
    torch_bf16 = gpt_oss.moe(x, dense, cfg, static=False)
    assert rel_err(out, ref) < 0.02 and rel_err(torch_bf16, ref) < 0.02


def test_weights_in_neither_form_are_refused() -> None:
    kept, _, cfg = layers(4, 2, torch.float32, seed=1)
    kept.down_scales = None  # MXFP4 gate_up, u8 down without scales
    router = torch.zeros(3, 4, device=DEVICE)
    with pytest.raises(ConfigError, match="fused MoE"):
        fused_moe(tokens(3), router, kept, 2, cfg.swiglu_alpha, cfg.swiglu_limit)
