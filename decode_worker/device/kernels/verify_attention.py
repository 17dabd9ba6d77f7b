"""Paged decode attention for a verify step: a request's consecutive queries share one KV pass.

A verify step (speculative decoding) holds a request in `1 + k` consecutive entries at positions
`pos .. pos + k`, every entry one query whose K/V `write_kv` (kernels/decode_attention.py) has
already stored. The single-query kernel would read the request's keys once per entry, `1 + k`
times; decode is bound by reading the KV, so here a program reads them once for up to QB queries:
```
first:  [bs] i64 per entry, the index of the first entry of its group (itself when alone)
leader: entry b with (b - first[b]) % QB == 0; it serves entries b .. b + n - 1, n <= QB the
        entries after it with the same `first` (a group longer than QB has several leaders)
stage 1, grid (bs, kv_heads, splits): a leader's tile is n x GROUP query rows (row r = query
        r // GROUP, head r % GROUP) over keys [lo, hi], lo = max(0, pos[b] - window), hi = the
        last query's position, split as the single-query kernel splits [lo, pos]; each row masks
        to its own keys: p <= pos_r (full layers), and p >= pos_r - window (SWA layers)
        -> each entry's partial output and log-sum-exp, in the single-query kernel's layout;
        a non-leader program loads nothing and stores nothing
stage 2: the single-query kernel's, per entry (sinks as there)
```
Everything the kernels read is a device tensor, so a CUDA graph captured for (entries bucket,
QB) serves any grouping of that many entries; graph padding rows are groups of one (`first[b]`
= b) at position 0 on page 0. SWA tables must be rings of at least `window + k + 1` positions
(`swa_ring_width(window + lookahead, ps)`), so the keys of [pos - window, pos + k] never share a
slot. A key block that is masked out for one row (the window of a later query starts past it)
leaves that row's running max at -inf: the exponentials use 0 in its place, so the row adds
nothing instead of a NaN.

Import only with triton available; on CPU the kernels run under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from decode_worker.device.kernels import INTERPRETED
from decode_worker.device.kernels.decode_attention import (
    BLOCK_N,
    _kv_block,
    _scores,
    _stage2_kernel,
    _weighted,
    stage2_meta,
)

# query rows (queries x heads of one KV head) of one program's tile: the most that compile for
# sm_90 without spilling at gpt-oss's and Qwen3's shapes (tests/unit/device/sm90_compile.py);
# float32 pools dot in IEEE float32 on CUDA cores, where 128 rows spill kilobytes
MAX_ROWS = {False: 128, True: 64}  # by `f32`


@triton.jit(do_not_specialize=["bs", "s_table", "ring", "window"],
            do_not_specialize_on_alignment=["pos_ptr", "first_ptr"])
def _grouped_stage1_kernel(  # type: ignore[no-untyped-def]
        q_ptr, kv_ptr, table_ptr, pos_ptr, first_ptr, part_ptr, lse_ptr, bs, sq_b, sq_h,
        s_page, s_kv, s_tok, s_table, ring, window, scale, GROUP: tl.constexpr,
        QB: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP32_DOT: tl.constexpr,
        ROUND_P: tl.constexpr):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    lead = tl.load(first_ptr + b)
    after = b + tl.arange(0, QB)  # [QB] the entries b may serve
    same = tl.load(first_ptr + after, mask=after < bs, other=-1) == lead  # [QB]
    n = tl.where((b - lead) % QB == 0, tl.sum(same.to(tl.int32), 0), 0)  # 0: not a leader
    rows, dims = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    entry, heads = b + rows // GROUP, kvh * GROUP + rows % GROUP  # [H] each
    row_ok, dim_ok = rows < n * GROUP, dims < HEAD_DIM
    q = tl.load(q_ptr + entry[:, None] * sq_b + heads[:, None] * sq_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [H, D]
    if FP32_DOT:
        q = q.to(tl.float32)
    pos_r = tl.load(pos_ptr + entry, mask=row_ok, other=0).to(tl.int32)  # [H] each row's query
    lo = tl.maximum(tl.load(pos_ptr + b).to(tl.int32) - window, 0)
    hi = tl.where(n > 0, tl.max(tl.where(row_ok, pos_r, -1), 0), lo - 1)  # lo - 1: no keys
    chunk = ((hi - lo + splits) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # cdiv twice
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi + 1)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for k0 in range(start, end, BLOCK_N):
        p, ok, k, v = _kv_block(kv_ptr, table_ptr, b, s_table, ring, k0, end, s_page, s_kv,
                                s_tok, kvh, dims, dim_ok, HEAD_DIM, PAGE, BLOCK_N)
        seen = (ok[None, :] & (p[None, :] <= pos_r[:, None])
                & (p[None, :] >= pos_r[:, None] - window))  # [H, N] each row's own keys
        s = tl.where(seen, _scores(q, k, FP32_DOT) * scale, float("-inf"))  # [H, N]
        new_m = tl.maximum(m, tl.max(s, 1))  # -inf for a row that has seen no key yet
        base_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # keeps exp(-inf - -inf) out
        corr = tl.exp(m - base_m)
        e = tl.exp(s - base_m[:, None])  # [H, N]
        denom = denom * corr + tl.sum(e, 1)
        acc = acc * corr[:, None] + _weighted(e, v, FP32_DOT, ROUND_P)  # [H, D]
        m = new_m
    full = denom > 0  # False for a split (or a row) without keys
    lse = tl.where(full, m + tl.log(tl.where(full, denom, 1.0)), float("-inf"))
    out = acc / tl.where(full, denom, 1.0)[:, None]  # [H, D]
    at = (entry * GROUP * tl.num_programs(1) + heads) * splits + split  # row of [bs, heads, S]
    tl.store(lse_ptr + at, lse, mask=row_ok)
    tl.store(part_ptr + at[:, None] * HEAD_DIM + dims[None, :], out,
             mask=row_ok[:, None] & dim_ok[None, :])


def paged_verify(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                 positions: torch.Tensor, first: torch.Tensor, max_len: int,
                 sinks: torch.Tensor, window: int, scale: float,
                 partial: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`paged_decode` (kernels/decode_attention.py, same arguments and result) for a step whose
    entries come in groups: `first` ([bs] i64 on the device) names each entry's group by its
    first entry; a group's entries are consecutive, at consecutive positions, with the same
    table row, and at most `max_len` long (a host bound: it sets the queries per program, so a
    graph keeps one value per bucket). Every entry's K/V must be written before the call."""
    bs, nh, hd = q.shape
    nkv = kv.shape[3]
    part, lse = partial
    splits = part.shape[2]
    group = nh // nkv
    f32 = kv.dtype == torch.float32 or q.dtype != kv.dtype  # else the native bf16/fp16 dot
    meta = grouped_stage1_meta(group, queries_per_program(max_len, group, f32), hd,
                               kv.shape[2], f32)
    _grouped_stage1_kernel[(bs, nkv, splits)](
        q, kv, table, positions, first, part, lse, bs, q.stride(0), q.stride(1), kv.stride(0),
        kv.stride(1), kv.stride(2), table.stride(0), table.shape[1], window, scale, **meta,
        num_warps=grouped_warps(meta))
    out = torch.empty(bs, nh * hd, dtype=q.dtype, device=q.device)  # [bs, heads * hd]
    _stage2_kernel[(bs, nkv)](part, lse, sinks, out, out.stride(0), splits,
                              **stage2_meta(group, hd), num_warps=2)
    return out


def queries_per_program(max_len: int, group: int, f32: bool) -> int:
    """QB: the queries one program serves, a power of two covering `max_len` when its rows
    (QB x `group` heads) fit MAX_ROWS[f32], else the most that fit (a longer group then has
    cdiv(max_len, QB) leaders, each reading the keys once)."""
    fit = max(1, MAX_ROWS[f32] // group)
    return min(triton.next_power_of_2(max(1, max_len)), 1 << (fit.bit_length() - 1))


# compile-time parameters (tests/unit/device/sm90_compile.py compiles with them)
def grouped_stage1_meta(group: int, queries: int, head_dim: int, page_size: int, f32: bool
                        ) -> dict[str, int | bool]:
    """As `stage1_meta` (kernels/decode_attention.py), with QB = `queries` per program."""
    return {"GROUP": group, "QB": queries, "HEAD_DIM": head_dim, "PAGE": page_size,
            "BLOCK_H": max(16, triton.next_power_of_2(queries * group)), "BLOCK_N": BLOCK_N,
            "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
            "FP32_DOT": f32 or INTERPRETED, "ROUND_P": not f32}


def grouped_warps(meta: dict[str, int | bool]) -> int:
    """8 warps from a 64 x 64 tile up (4 spill there at 64 x 128, sm_90, triton 3.9)."""
    return 8 if int(meta["BLOCK_H"]) * int(meta["BLOCK_D"]) >= 64 * 64 else 4
