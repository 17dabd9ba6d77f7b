"""Paged decode attention in Triton (flash-decoding), reading K/V straight from the pools.

One decode token per request. Per layer: `write_kv` stores the new K/V into its page, then two
kernels attend over the request's keys (`paged_decode`):
```
stage 1, grid (bs, kv_heads, splits): the GROUP query heads of one KV head as one tile walk
         one split of the request's key range in BLOCK_N-token blocks; page of key p =
         table[req, (p // page_size) % ring], slot p % page_size; a running max / sum /
         accumulator in float32 -> a partial output [GROUP, hd] and its log-sum-exp
stage 2, grid (bs, kv_heads): merge each head's splits by their log-sum-exp, the head's
         sink logit added to the denominator only
```
Key range of a request at position `pos` (read from a device tensor, so no host sync and the
kernels can live in a CUDA graph whose table is wider than any request needs):
```
full layers:  [0, pos]                         ring = table width (the modulo is a no-op)
SWA layers:   [max(0, pos - window), pos]       ring = cdiv(window, ps) + 1 table columns
split s of S: [lo + s * chunk, min(lo + (s + 1) * chunk, pos + 1)),
              chunk = cdiv(n, S) rounded up to BLOCK_N (splits past the keys are empty)
```
`window` = earlier tokens a sliding query sees (HF `sliding_window - 1`, 127 for gpt-oss); the
window may start inside a page (each key looks up its own page). Pool layout per layer:
[N + 1, 2, ps, kvh, hd] (device/kv_pool.py). Scores and accumulators are float32: an fp32 pool
(or a q of another dtype than the pool) runs the dots in IEEE fp32 (no TF32), a bf16/fp16 pool
with a q of its dtype uses the native dot with P rounded to the pool dtype (as SGLang does).

Import only with triton available; on CPU the kernels run under `TRITONINTERPRETED=1` (tests).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from decode_worker.device.kernels import INTERPRETED

BLOCK_N = 64  # keys per block: one [64, hd] K tile
# INTERPRETED: Triton's interpreter (3.9) multiplies bf16 tiles as their raw uint16 bits, so under
# it every dot runs on float32 copies of the same (already rounded) operands, what the GPU's
# native dot does; it also rounds f32 -> bf16 toward zero (the GPU: to nearest even), so
# `write_kv` casts first
NO_WINDOW = 1 << 30  # `window` of a full-attention layer: every earlier key


@triton.jit(do_not_specialize=["s_table", "ring"], do_not_specialize_on_alignment=["pos_ptr"])
def _write_kv_kernel(  # type: ignore[no-untyped-def]
        k_ptr, v_ptr, kv_ptr, table_ptr, pos_ptr, sk_b, sk_h, sv_b, sv_h, s_page, s_kv, s_tok,
        s_table, ring, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    page = tl.load(table_ptr + b * s_table + (pos // PAGE) % ring).to(tl.int64)
    heads = tl.arange(0, BLOCK_KVH)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [KVH, D]
    k = tl.load(k_ptr + b * sk_b + heads[:, None] * sk_h + dims[None, :], mask=mask)
    v = tl.load(v_ptr + b * sv_b + heads[:, None] * sv_h + dims[None, :], mask=mask)
    # pool strides: head = HEAD_DIM, dim = 1 (a page's [ps, kvh, hd] block is contiguous)
    dst = kv_ptr + page * s_page + (pos % PAGE) * s_tok + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + s_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_block(kv_ptr, table_ptr, b, s_table, ring, k0, end, s_page, s_kv, s_tok, kvh,  # type: ignore[no-untyped-def]
              dims, dim_ok, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """The BLOCK_N keys from position `k0` of request row `b`'s KV head `kvh`, masked from
    `end` on: their positions [N], that mask [N], K and V [N, D]; each key read from its own
    page (`table[b, (p // PAGE) % ring]`, slot `p % PAGE`)."""
    p = k0 + tl.arange(0, BLOCK_N)  # [N] key positions
    ok = p < end
    page = tl.load(table_ptr + b * s_table + (p // PAGE) % ring, mask=ok, other=0)
    base = kv_ptr + page.to(tl.int64) * s_page + (p % PAGE) * s_tok + kvh * HEAD_DIM  # [N]
    kv_ok = ok[:, None] & dim_ok[None, :]
    k = tl.load(base[:, None] + dims[None, :], mask=kv_ok, other=0.0)  # [N, D]
    v = tl.load(base[:, None] + s_kv + dims[None, :], mask=kv_ok, other=0.0)  # [N, D]
    return p, ok, k, v


@triton.jit
def _scores(q, k, FP32_DOT: tl.constexpr):  # type: ignore[no-untyped-def]
    """q [H, D] . k [N, D]^T -> [H, N] float32 (IEEE float32, or the native dot)."""
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _weighted(e, v, FP32_DOT: tl.constexpr, ROUND_P: tl.constexpr):  # type: ignore[no-untyped-def]
    """e [H, N] . v [N, D] -> [H, D] float32; with ROUND_P, e in the pool dtype first (the
    native dot's P, as SGLang rounds it)."""
    if ROUND_P:
        e = e.to(v.dtype)
    if FP32_DOT:
        pv = tl.dot(e.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(e, v)
    return pv


@triton.jit(do_not_specialize=["s_table", "ring", "window"],
            do_not_specialize_on_alignment=["pos_ptr"])
def _stage1_kernel(  # type: ignore[no-untyped-def]
        q_ptr, kv_ptr, table_ptr, pos_ptr, part_ptr, lse_ptr, sq_b, sq_h, s_page, s_kv, s_tok,
        s_table, ring, window, scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr, ROUND_P: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    lo = tl.maximum(pos - window, 0)
    chunk = ((pos - lo + splits) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # cdiv twice
    start = lo + split * chunk
    end = tl.minimum(start + chunk, pos + 1)
    rows, dims = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + rows  # [H]
    row_ok, dim_ok = rows < GROUP, dims < HEAD_DIM
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [H, D]
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for k0 in range(start, end, BLOCK_N):
        _, ok, k, v = _kv_block(kv_ptr, table_ptr, b, s_table, ring, k0, end, s_page, s_kv,
                                s_tok, kvh, dims, dim_ok, HEAD_DIM, PAGE, BLOCK_N)
        s = tl.where(ok[None, :], _scores(q, k, FP32_DOT) * scale, float("-inf"))  # [H, N]
        new_m = tl.maximum(m, tl.max(s, 1))  # finite: every block holds a key
        corr = tl.exp(m - new_m)
        e = tl.exp(s - new_m[:, None])  # [H, N]
        denom = denom * corr + tl.sum(e, 1)
        acc = acc * corr[:, None] + _weighted(e, v, FP32_DOT, ROUND_P)  # [H, D]
        m = new_m
    full = denom > 0  # False for a split past the request's keys
    lse = tl.where(full, m + tl.log(tl.where(full, denom, 1.0)), float("-inf"))
    out = acc / tl.where(full, denom, 1.0)[:, None]  # [H, D]
    at = (b * GROUP * tl.num_programs(1) + heads) * splits + split  # row of [bs, heads, S]
    tl.store(lse_ptr + at, lse, mask=row_ok)
    tl.store(part_ptr + at[:, None] * HEAD_DIM + dims[None, :], out,
             mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _stage2_kernel(  # type: ignore[no-untyped-def]
        part_ptr, lse_ptr, sink_ptr, out_ptr, so_b, num_splits, GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    b, kvh = tl.program_id(0), tl.program_id(1)
    rows, dims = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + rows  # [H]
    row_ok, dim_ok = rows < GROUP, dims < HEAD_DIM
    at = (b * GROUP * tl.num_programs(1) + heads) * num_splits  # [H] first split's row
    # the sink starts the running max; its exp term, 1, starts the denominator
    m = tl.load(sink_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)  # [H]
    denom = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(0, num_splits):
        lse = tl.load(lse_ptr + at + split, mask=row_ok, other=float("-inf"))  # [H]
        part = tl.load(part_ptr + (at + split)[:, None] * HEAD_DIM + dims[None, :],
                       mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [H, D]
        new_m = tl.maximum(m, lse)  # finite thanks to the sink
        corr, w = tl.exp(m - new_m), tl.exp(lse - new_m)  # w = 0 for an empty split
        denom = denom * corr + w
        acc = acc * corr[:, None] + part * w[:, None]
        m = new_m
    tl.store(out_ptr + b * so_b + heads[:, None] * HEAD_DIM + dims[None, :],
             (acc / denom[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
             positions: torch.Tensor) -> None:
    """Store k, v ([bs, kvh, hd], inner dim contiguous) of the token at `positions[i]` ([bs])
    into its slot of `kv` (one layer's pages [N + 1, 2, ps, kvh, hd], contiguous), page
    `table[i, (pos // ps) % table.shape[1]]` (a full table or an SWA ring)."""
    bs, kvh, hd = k.shape
    if INTERPRETED and k.dtype != kv.dtype:  # the interpreter truncates f32 -> bf16; torch and
        k, v = k.to(kv.dtype), v.to(kv.dtype)  # the GPU round to nearest even
    _write_kv_kernel[(bs,)](
        k, v, kv, table, positions, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), table.stride(0), table.shape[1],
        **write_meta(kvh, hd, kv.shape[2]))


def paged_decode(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                 positions: torch.Tensor, sinks: torch.Tensor, window: int, scale: float,
                 partial: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Attention of q ([bs, heads, hd], inner dim contiguous) at `positions` ([bs] on the
    device) over its keys in `kv` ([N + 1, 2, ps, kvh, hd], contiguous) through `table`
    ([bs, W] i32/i64: full table, ring = W; or SWA ring) -> [bs, heads * hd] in q's dtype.

    `window`: NO_WINDOW for full layers. `partial`: scratch (part [bs, heads, S, hd] f32,
    lse [bs, heads, S] f32) from `partials`; its S is the split count. sinks: [heads].
    """
    bs, nh, hd = q.shape
    nkv = kv.shape[3]
    part, lse = partial
    splits = part.shape[2]
    group = nh // nkv
    f32 = kv.dtype == torch.float32 or q.dtype != kv.dtype  # else the native bf16/fp16 dot
    _stage1_kernel[(bs, nkv, splits)](
        q, kv, table, positions, part, lse, q.stride(0), q.stride(1), kv.stride(0),
        kv.stride(1), kv.stride(2), table.stride(0), table.shape[1], window, scale,
        **stage1_meta(group, hd, kv.shape[2], f32), num_warps=4)
    out = torch.empty(bs, nh * hd, dtype=q.dtype, device=q.device)  # [bs, heads * hd]
    _stage2_kernel[(bs, nkv)](part, lse, sinks, out, out.stride(0), splits,
                              **stage2_meta(group, hd), num_warps=2)
    return out


def partials(bs: int, heads: int, head_dim: int, splits: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 scratch for `splits` splits, reusable by every layer of a step."""
    part = torch.empty(bs, heads, splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(bs, heads, splits, dtype=torch.float32, device=device)  # [bs, heads, S]
    return part, lse  # part: [bs, heads, S, hd]


# compile-time parameters of each kernel (tests/unit/device/sm90_compile.py compiles with them)
def write_meta(kv_heads: int, head_dim: int, page_size: int) -> dict[str, int]:
    return {"KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "PAGE": page_size,
            "BLOCK_KVH": triton.next_power_of_2(kv_heads),
            "BLOCK_D": triton.next_power_of_2(head_dim)}


def stage1_meta(group: int, head_dim: int, page_size: int, f32: bool) -> dict[str, int | bool]:
    """`f32`: IEEE float32 dots (an fp32 pool, or q of another dtype); tl.dot wants every
    tile dimension >= 16, so the group's rows and head_dim are padded to it."""
    return {"GROUP": group, "HEAD_DIM": head_dim, "PAGE": page_size,
            "BLOCK_H": max(16, triton.next_power_of_2(group)), "BLOCK_N": BLOCK_N,
            "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
            "FP32_DOT": f32 or INTERPRETED, "ROUND_P": not f32}


def stage2_meta(group: int, head_dim: int) -> dict[str, int]:
    return {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_H": triton.next_power_of_2(group),
            "BLOCK_D": triton.next_power_of_2(head_dim)}
