"""Routed experts in four Triton launches: route + align, gate_up, down, sum (gpt-oss's
clamped SwiGLU with biases, or Qwen3-MoE's plain SiLU-gated experts, `silu`).

    route_and_align   router logits [T, E] -> top-k, softmax, pairs sorted per expert (moe_align)
    gate_up kernel    per block of BM pairs of one expert: x[token] @ W_gate_up[e] + bias,
                      clamped SwiGLU -> act [T * k, I]
    down kernel       act @ W_down[e] + bias, times the pair's router weight -> [T * k, H] f32
    sum kernel        the k pairs of each token -> [T, H] in x's dtype

Float32 accumulation throughout; float32 activations multiply in IEEE float32 (no TF32).

Expert weights come in two forms (`ExpertTensors`, the fields of the model's `LayerWeights`):
- MXFP4 as the checkpoint stores it (scales set): gate_up [E, 2I, H / 2] u8 with gate/up rows
  interleaved (row 2j gate j, row 2j + 1 up j, read in place by the kernel: no permutation at
  load), down [E, H, I / 2] u8, scales [E, rows, K / 32] u8; decoded per tile (kernels/mxfp4.py);
- dense (scales None): gate_up [E, H, 2I] with [gate | up] columns, down [E, I, H], in x's dtype.
Biases are dense in both: gate_up_b [E, 2I] as [gate | up], down_b [E, H].

Every launch has a static grid for a given T (the worst-case block count), so a CUDA graph holds
the whole MoE; no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton

from decode_worker.device.kernels import INTERPRETED
from decode_worker.device.kernels.moe_align import Routing, route_and_align
from decode_worker.device.kernels.moe_gemm import down_kernel, gate_up_kernel, sum_kernel
from decode_worker.errors import ConfigError


class ExpertTensors(Protocol):
    """One layer's expert weights (see the module docstring for the two forms)."""

    gate_up: torch.Tensor
    gate_up_b: torch.Tensor
    down: torch.Tensor
    down_b: torch.Tensor
    gate_up_scales: torch.Tensor | None
    down_scales: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class MoeBlocks:
    """Tile sizes of the two GEMM kernels (BM is also the routing's padding unit)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def choose_blocks(num_tokens: int, top_k: int, num_experts: int, mxfp4: bool,
                  dtype: torch.dtype) -> MoeBlocks:
    """Hopper (sm_90) tiles by the average number of pairs per expert.

    Decode (1-256 tokens over 32-128 experts: a few pairs per expert) reads each hit expert's
    weights once: BM = 16 keeps the padding small, BN = 64 makes the decoded weight tile the
    64-row left operand of a wgmma, BK = 128 gives each thread 32 MXFP4 bytes per step (decoding
    is ALU work; fewer, larger steps spend less on loop overhead). More pairs per expert (large
    batches, prefill chunks) raise BM so a decoded tile serves more rows. Each choice compiles
    for sm_90 with triton 3.6 without register spills (scripts/compile_moe_kernels.py checks).
    Dense weights take a smaller BK so the pipelined tiles fit in shared memory."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        bm, bk, warps = 16, 128, 4
    elif per_expert <= 48:
        bm, bk, warps = 32, 128, 8
    else:
        bm, bk, warps = 64, 64, 8
    if not mxfp4:
        bk = 64 if dtype != torch.float32 else 32
    return MoeBlocks(bm, 64, bk, warps, 3 if dtype != torch.float32 else 2)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w: ExpertTensors, top_k: int,
              alpha: float, limit: float, *, silu: bool = False,
              renormalize: bool = True) -> torch.Tensor:
    """x [T, H], router_logits [T, E] -> sum over the top-k experts of
    `softmax weight * (swiglu(x @ gate_up + b) @ down + b)`: [T, H] in x's dtype.
    `silu`: the plain SiLU-gated experts of Qwen3-MoE (`silu(gate) * up`; alpha and limit
    unused); `renormalize` False: weights over every expert's softmax (norm_topk_prob false).

    Raises ConfigError for weights the kernels cannot read (shapes in the module docstring)."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.zeros_like(x)  # [0, H]
    mxfp4 = _check(x, w)
    blocks = choose_blocks(num_tokens, top_k, router_logits.shape[1], mxfp4, x.dtype)
    routing = route_and_align(router_logits, top_k, blocks.block_m, renormalize)
    act = _gate_up(x.contiguous(), routing, w, blocks, alpha, limit, silu)  # [T * k, I]
    out = _down(act, routing, w, blocks, hidden)  # [T * k, H] f32
    y = torch.empty_like(x)  # [T, H]
    grid = (num_tokens, triton.cdiv(hidden, 256))
    sum_kernel[grid](out, y, hidden, TOP_K=top_k, BN=256)
    return y


def _check(x: torch.Tensor, w: ExpertTensors) -> bool:
    """True for MXFP4 weights; ConfigError unless the weights match one form."""
    mxfp4 = w.gate_up_scales is not None and w.down_scales is not None
    if mxfp4:
        ok = w.gate_up.dtype == w.down.dtype == torch.uint8 and x.shape[1] % 32 == 0
    else:
        ok = w.gate_up.dtype == w.down.dtype == x.dtype
    if not ok:
        raise ConfigError(f"fused MoE: expert weights {w.gate_up.dtype}/{w.down.dtype} "
                          f"(MXFP4: {mxfp4}) do not fit activations {x.dtype} of width "
                          f"{x.shape[1]}")
    return mxfp4


def _weight_args(weight: torch.Tensor, scales: torch.Tensor | None) -> tuple[object, ...]:
    """(weight, scales, stride_we, stride_wn, stride_wk, stride_se, stride_sn) for the kernels.

    MXFP4 [E, rows, K / 2] u8: a row is an output feature. Dense [E, K, N]: a column is one."""
    if scales is not None:
        return (weight, scales, weight.stride(0), weight.stride(1), 1,
                scales.stride(0), scales.stride(1))
    return weight, weight, weight.stride(0), weight.stride(2), weight.stride(1), 0, 0


def _gate_up(x: torch.Tensor, routing: Routing, w: ExpertTensors, blocks: MoeBlocks,
             alpha: float, limit: float, silu: bool = False) -> torch.Tensor:
    mxfp4 = w.gate_up_scales is not None
    inter = w.gate_up_b.shape[1] // 2
    num_pairs = routing.topk_ids.numel()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T * k, I]
    # gate j / up j: MXFP4 rows 2j / 2j + 1 (interleaved), dense columns j / I + j
    gate_step, up_shift = (2, 1) if mxfp4 else (1, inter)
    grid = (routing.num_blocks, triton.cdiv(inter, blocks.block_n))
    weight, scales, *strides = _weight_args(w.gate_up, w.gate_up_scales)
    gate_up_kernel[grid](
        x, weight, scales, w.gate_up_b, act, routing.sorted_ids, routing.expert_ids,
        num_pairs, x.shape[1], inter, x.stride(0), *strides, w.gate_up_b.stride(0),
        act.stride(0), gate_step, up_shift, alpha, limit,
        TOP_K=routing.topk_ids.shape[1], W_MX=mxfp4, IEEE=x.dtype == torch.float32,
        UPCAST=INTERPRETED,
        BM=blocks.block_m, BN=blocks.block_n, BK=blocks.block_k, SILU=silu,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    return act


def _down(act: torch.Tensor, routing: Routing, w: ExpertTensors, blocks: MoeBlocks,
          hidden: int) -> torch.Tensor:
    num_pairs, inter = act.shape
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=act.device)  # [T * k, H]
    weight, scales, *strides = _weight_args(w.down, w.down_scales)
    grid = (routing.num_blocks, triton.cdiv(hidden, blocks.block_n))
    down_kernel[grid](
        act, weight, scales, w.down_b, routing.topk_w, out, routing.sorted_ids,
        routing.expert_ids, num_pairs, inter, hidden, act.stride(0), *strides,
        w.down_b.stride(0), out.stride(0),
        W_MX=w.down_scales is not None, IEEE=act.dtype == torch.float32,
        UPCAST=INTERPRETED,
        BM=blocks.block_m, BN=blocks.block_n, BK=blocks.block_k,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    return out
