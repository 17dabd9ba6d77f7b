"""The GEMM kernels of the fused MoE (fused_moe.py launches them; layouts are documented there).

Each program owns BM rows of one expert's pairs (a block of `sorted_ids`, its expert in
`expert_ids`; -1 exits at once) and BN output columns, walks the input features in BK steps with
a float32 accumulator, and finishes with the epilogue: bias and clamped SwiGLU (gate_up), bias
and router weight (down). Padding rows (pair id = T * k) load zeros and store nothing.

The dot is taken transposed, `acc [BN, BM] += W [BN, BK] @ x^T [BK, BM]`: the weight tile, decoded
in registers, is the left operand (on Hopper a wgmma takes that one from registers, the other
from shared memory), and a decode step's few rows per expert are the small N side.
"""

from __future__ import annotations

import triton
import triton.language as tl

from decode_worker.device.kernels.mxfp4 import mxfp4_tile


@triton.jit
def _weight_tile(w_ptr, s_ptr, cols, k0, k_total, n_ok, stride_wn, stride_wk, stride_sn,
                 W_MX: tl.constexpr, OUT: tl.constexpr, BK: tl.constexpr):
    """Output features `cols` [BN] over inputs [k0, k0 + BK) of one expert -> [BN, BK] in OUT."""
    if W_MX:
        kb = k0 // 2 + tl.arange(0, BK // 2)  # [BK / 2] bytes
        mask = n_ok[:, None] & (kb < k_total // 2)[None, :]
        tile = mxfp4_tile(w_ptr, s_ptr, cols, kb, mask, stride_wn, stride_sn, OUT)
    else:
        k = k0 + tl.arange(0, BK)
        mask = n_ok[:, None] & (k < k_total)[None, :]
        tile = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :] * stride_wk, mask=mask,
                       other=0.0).to(OUT)
    return tile


@triton.jit
def _dot(w, xt, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + w @ xt in float32. IEEE: float32 operands without TF32. UPCAST (Triton's interpreter
    only, whose dot reads 16-bit float tiles as raw integers): float32 copies of the tiles, the
    same products (a 16-bit float product is exact in float32) and float32 sums."""
    if UPCAST:
        acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(w, xt, acc, input_precision="ieee")
    else:
        acc = tl.dot(w, xt, acc)
    return acc


@triton.jit
def _block(sorted_ptr, w_ptr, s_ptr, expert, num_pairs, num_cols, stride_we, stride_se,
           BM: tl.constexpr, BN: tl.constexpr):
    """This program's rows (pair ids [BM] and which are real), columns ([BN] and which exist)
    and its expert's weight and scale base pointers."""
    pairs = tl.load(sorted_ptr + tl.program_id(0) * BM + tl.arange(0, BM))  # [BM]
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    return (pairs, pairs < num_pairs, n, n < num_cols, w_ptr + expert * stride_we,
            s_ptr + expert * stride_se)


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, sorted_ptr, expert_ptr,
                    num_pairs, hidden, inter, stride_xt, stride_we, stride_wn, stride_wk,
                    stride_se, stride_sn, stride_be, stride_at, gate_step, up_shift, alpha, limit,
                    TOP_K: tl.constexpr, W_MX: tl.constexpr, IEEE: tl.constexpr,
                    UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SILU: tl.constexpr):
    """grid (blocks, cdiv(I, BN)): act[pair, n] = swiglu(x[pair // k] @ W[e] + b[e]); SILU:
    the plain SiLU-gated form `silu(gate) * up` (Qwen3-MoE), else gpt-oss's clamped one."""
    expert = tl.load(expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, row_ok, n, n_ok, w_e, s_e = _block(sorted_ptr, w_ptr, s_ptr, expert, num_pairs,
                                              inter, stride_we, stride_se, BM, BN)
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64)[None, :] * stride_xt  # [1, BM]
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)  # transposed: [act column, pair]
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_rows + k[:, None], mask=(k < hidden)[:, None] & row_ok[None, :],
                     other=0.0)  # [BK, BM]
        g = _weight_tile(w_e, s_e, n * gate_step, k0, hidden, n_ok, stride_wn, stride_wk,
                         stride_sn, W_MX, xt.dtype, BK)
        acc_g = _dot(g, xt, acc_g, IEEE, UPCAST)
        u = _weight_tile(w_e, s_e, n * gate_step + up_shift, k0, hidden, n_ok, stride_wn,
                         stride_wk, stride_sn, W_MX, xt.dtype, BK)
        acc_u = _dot(u, xt, acc_u, IEEE, UPCAST)
    bias = b_ptr + expert * stride_be + n
    gate = acc_g + tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    up = acc_u + tl.load(bias + inter, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SILU:
        e = tl.exp(-tl.abs(gate))  # sigmoid from exp(-|z|): no overflow
        act = up * (gate * tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e)))
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        z = gate * alpha
        e = tl.exp(-tl.abs(z))  # sigmoid from exp(-|z|): no overflow for gates far below -limit
        act = (up + 1.0) * (gate * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)))
    out = act_ptr + pairs.to(tl.int64)[None, :] * stride_at + n[:, None]  # [BN, BM]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


@triton.jit
def down_kernel(act_ptr, w_ptr, s_ptr, b_ptr, topw_ptr, out_ptr, sorted_ptr, expert_ptr,
                 num_pairs, inter, hidden, stride_at, stride_we, stride_wn, stride_wk,
                 stride_se, stride_sn, stride_be, stride_ot,
                 W_MX: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """grid (blocks, cdiv(H, BN)): out[pair, n] = w[pair] * (act[pair] @ W[e] + b[e])."""
    expert = tl.load(expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, row_ok, n, n_ok, w_e, s_e = _block(sorted_ptr, w_ptr, s_ptr, expert, num_pairs,
                                              hidden, stride_we, stride_se, BM, BN)
    a_rows = act_ptr + pairs.to(tl.int64)[None, :] * stride_at  # [1, BM]
    acc = tl.zeros([BN, BM], dtype=tl.float32)  # transposed: [hidden column, pair]
    for k0 in range(0, inter, BK):
        k = k0 + tl.arange(0, BK)
        at = tl.load(a_rows + k[:, None], mask=(k < inter)[:, None] & row_ok[None, :],
                     other=0.0)  # [BK, BM]
        w = _weight_tile(w_e, s_e, n, k0, inter, n_ok, stride_wn, stride_wk, stride_sn,
                         W_MX, at.dtype, BK)
        acc = _dot(w, at, acc, IEEE, UPCAST)
    acc += tl.load(b_ptr + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    acc *= tl.load(topw_ptr + pairs, mask=row_ok, other=0.0)[None, :]
    out = out_ptr + pairs.to(tl.int64)[None, :] * stride_ot + n[:, None]  # [BN, BM]
    tl.store(out, acc, mask=n_ok[:, None] & row_ok[None, :])


@triton.jit
def sum_kernel(src_ptr, dst_ptr, hidden, TOP_K: tl.constexpr, BN: tl.constexpr):
    """grid (T, cdiv(H, BN)): dst[t] = sum over j of src[t * k + j] (float32 sum)."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(src_ptr + (t * TOP_K + j) * hidden + n, mask=n < hidden, other=0.0)
    tl.store(dst_ptr + t * hidden + n, acc.to(dst_ptr.dtype.element_ty), mask=n < hidden)
