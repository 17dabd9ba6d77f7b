"""MXFP4 weight tiles decoded inside Triton kernels, bit for bit as `weights.dequantize_mxfp4`.

Checkpoint layout (gpt-oss): `blocks [E, rows, K / 32, 16] uint8` (viewed here as
`[E, rows, K / 2]`: byte `kb` of a row holds values `2 kb` (low nibble) and `2 kb + 1` (high
nibble)), `scales [E, rows, K / 32] uint8` (E8M0: value * 2 ** (scale - 127), one per 32 values,
so byte `kb` uses scale `kb // 16`). A row is one output feature, K the input features.

A tile is loaded row-major (`[BN, BK / 2]` bytes, contiguous along k), decoded into `lo` (even
k) and `hi` (odd k) and interleaved into `[BN, BK]`: the left operand of the GEMMs, which multiply
weights by activations (out^T = W x^T, so the few token rows of a decode step are the dot's N and
the many weight rows its M).

Decoding builds float32 bits with the scale folded into the exponent (no multiply, no
subnormal): code `c` = sign s, exponent e (2 bits), mantissa m; for e > 0 the value is
2 ** (e - 1) * (1 + m / 2) * 2 ** (scale - 127), exponent field e + scale - 1; for e = 0 it is
m * 0.5 * 2 ** (scale - 127), exponent field scale - 1 with an empty mantissa. The bits are then
cast to the output dtype (bf16 and float32 hold them exactly, fp16 within its range). This equals
torch's `ldexp` bit for bit for scale bytes 2..252 (2 ** -125 .. 2 ** 125); checkpoints use a few
around 127 (outside that range the result would be subnormal or overflow; 255 is NaN in the MX
spec).

Cost, from sm_90 SASS of triton 3.6 (scripts/compile_moe_kernels.py): about 6.5 integer
instructions per value and 25 per byte with the loop around them, so a step that reads many
experts is bound by the SMs' integer throughput (an estimate: ~1 TB/s of MXFP4 on an H200, a
quarter of its memory bandwidth), not by memory. Not measured on a device yet; a table lookup in
inline PTX (`prmt`) is the known faster decode, to be checked there bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton element type of a torch float dtype (float32, bfloat16, float16)."""
    return _TL_DTYPES[dtype]


@triton.jit
def _decode(code, scale_bits):
    """4-bit codes and `(scale - 1) << 23` (int32 tiles) -> float32 values (module docstring)."""
    mag = code & 7  # exponent and mantissa
    bits = tl.where(mag > 1, (mag << 22) + scale_bits, mag * scale_bits)
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile(blk_ptr, scl_ptr, rows, kb, mask, stride_bn, stride_sn, OUT: tl.constexpr):
    """Weight rows `rows` [BN] at bytes `kb` [BKH] of one expert -> [BN, 2 BKH] in OUT
    (column 2 i + nibble for byte i). `blk_ptr` / `scl_ptr`: the expert's blocks [rows, K / 2]
    and scales [rows, K / 32] (last axis contiguous); `mask` [BN, BKH]: masked values are 0."""
    b = tl.load(blk_ptr + rows[:, None] * stride_bn + kb[None, :], mask=mask, other=0)
    s = tl.load(scl_ptr + rows[:, None] * stride_sn + (kb // 16)[None, :], mask=mask, other=127)
    b = b.to(tl.int32)  # [BN, BKH]
    scale_bits = (s.to(tl.int32) - 1) << 23  # [BN, BKH]
    lo = _decode(b & 15, scale_bits).to(OUT)
    hi = _decode(b >> 4, scale_bits).to(OUT)
    return tl.interleave(lo, hi)  # [BN, BK]


@triton.jit
def _dequant_kernel(blk_ptr, scl_ptr, out_ptr, num_rows, k_half,
                    stride_be, stride_bn, stride_se, stride_sn, stride_oe, stride_ok,
                    OUT: tl.constexpr, BKH: tl.constexpr, BN: tl.constexpr):
    """grid (E, cdiv(K / 2, BKH), cdiv(rows, BN)): out[e, k, row] = W[e, row, k]."""
    e = tl.program_id(0)
    kb = tl.program_id(1) * BKH + tl.arange(0, BKH)  # [BKH]
    rows = tl.program_id(2) * BN + tl.arange(0, BN)  # [BN]
    mask = (rows < num_rows)[:, None] & (kb < k_half)[None, :]  # [BN, BKH]
    tile = mxfp4_tile(blk_ptr + e * stride_be, scl_ptr + e * stride_se, rows, kb, mask,
                      stride_bn, stride_sn, OUT)  # [BN, 2 BKH]
    k = tl.program_id(1) * 2 * BKH + tl.arange(0, 2 * BKH)  # [2 BKH]
    out = out_ptr + e * stride_oe + rows[:, None] + k[None, :] * stride_ok
    tl.store(out, tile, mask=(rows < num_rows)[:, None] & (k < 2 * k_half)[None, :])


def dequantize_tiles(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernels' decoding as a tensor: blocks [E, rows, G, 16] (or [E, rows, K / 2]) u8,
    scales [E, rows, G] u8 -> [E, K, rows] in `dtype`, the orientation of `dequantize_mxfp4`.

    A check of `mxfp4_tile` (tests compare the two bit for bit); the MoE kernels never build
    dense weights."""
    experts, rows = blocks.shape[:2]
    blk = blocks.reshape(experts, rows, -1).contiguous()  # [E, rows, K / 2] u8
    scl = scales.contiguous()  # [E, rows, G] u8
    k_half = blk.shape[2]
    out = torch.empty(experts, 2 * k_half, rows, dtype=dtype, device=blocks.device)  # [E, K, rows]
    bkh, bn = 32, 32
    grid = (experts, triton.cdiv(k_half, bkh), triton.cdiv(rows, bn))
    _dequant_kernel[grid](blk, scl, out, rows, k_half, blk.stride(0), blk.stride(1),
                          scl.stride(0), scl.stride(1), out.stride(0), out.stride(1),
                          OUT=tl_dtype(dtype), BKH=bkh, BN=bn)
    return out
