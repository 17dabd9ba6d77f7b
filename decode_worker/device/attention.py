"""Attention over the paged pools, with gpt-oss sinks, for decode batches and for prefill.

Window convention: `window` = earlier tokens a sliding query sees (HF `sliding_window - 1`, 127
for gpt-oss). A sliding query at position p sees keys [p - window, p]; a full query sees [0, p].

Slot of position `pos` in a page table: page `table[pos // page_size]`, offset `pos % page_size`.
Page 0 is the dummy page: writes aimed at it (graph padding, SWA pages that are not held) land
there harmlessly, and reads from it are always masked out.

Everything is vectorized: one gather per layer over the whole batch, no per-token Python loop.
On CUDA the decode step uses the Triton kernel instead (device/attention_triton.py,
`model.attention_backend`); `DecodeAttention` is the CPU path and the kernel's reference.
"""

from __future__ import annotations

import torch

from decode_worker.device.kv_pool import KVPools
from decode_worker.device.query_groups import QueryGroups

SCORE_BUDGET = 2**26  # f32 scores per prefill chunk (256 MiB): bounds [heads, chunk, keys]
DECODE_KV_BUDGET = 2**25  # gathered K/V elements per decode chunk: bounds [bs, keys, 2, kvh, hd]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
           sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with one sink logit per head (in the denominator only).

    q: [B, Q, heads, hd]; k, v: [kv_heads, B, L, hd] (the layout a gather from
    `pool_view` yields, so no copy is needed before the matmuls); bias: [B, Q, L] float32,
    0 where visible and -inf where masked; sinks: [heads]. Returns [B, Q, heads * hd].
    Scores are computed in float32.
    """
    b, nq, nh, hd = q.shape
    nkv = k.shape[0]
    g = nh // nkv
    # fold the g query heads of a KV head into the rows: plain batched matmuls
    qg = q.float().view(b, nq, nkv, g, hd).permute(2, 0, 3, 1, 4).reshape(nkv, b, g * nq, hd)
    # qg: [kvh, B, g * Q, hd]
    s = torch.matmul(qg, k.float().transpose(-1, -2)).view(nkv, b, g, nq, -1) * scale
    s = s + bias[None, :, None]  # s: [kvh, B, g, Q, L]
    sink = sinks.float().view(nkv, 1, g, 1)  # [kvh, 1, g, 1]
    top = torch.maximum(s.amax(-1), sink)  # [kvh, B, g, Q]; finite thanks to the sink
    e = torch.exp(s - top[..., None])  # [kvh, B, g, Q, L]
    denom = e.sum(-1) + torch.exp(sink - top)  # [kvh, B, g, Q]
    out = torch.matmul(e.view(nkv, b, g * nq, -1), v.float())  # [kvh, B, g * Q, hd]
    out = out / denom.view(nkv, b, g * nq, 1)  # [kvh, B, g * Q, hd]
    out = out.view(nkv, b, g, nq, hd).permute(1, 3, 0, 2, 4)  # [B, Q, kvh, g, hd]
    return out.reshape(b, nq, nh * hd).to(q.dtype)


def pool_view(kv: torch.Tensor) -> torch.Tensor:
    """One layer's pages [N + 1, 2, ps, kvh, hd] viewed as [2, kvh, N + 1, ps, hd]; indexing
    it with (pages, offsets) of shape S gives [2, kvh, *S, hd]."""
    return kv.permute(1, 3, 0, 2, 4)


def attend_split(q: torch.Tensor, kv: torch.Tensor, pages: torch.Tensor, offs: torch.Tensor,
                 bias: torch.Tensor, sinks: torch.Tensor, scale: float, chunk: int
                 ) -> torch.Tensor:
    """Decode attention over key chunks merged by running max / sum (split-K, flash-decoding).

    Same result as gathering all keys and calling `attend`, with memory bounded by `chunk`
    keys. q: [bs, heads, hd]; kv: one layer's pages [N + 1, 2, ps, kvh, hd]; pages/offs:
    [bs, L] slots; bias: [bs, 1, L]. The sink starts the running max (its exp term is 1).
    The chunk count depends only on L, so this is graph-capturable.
    """
    bs, nh, hd = q.shape
    nkv = kv.shape[3]
    g = nh // nkv
    qg = q.float().view(bs, nkv, g, hd)  # [bs, kvh, g, hd]
    run_max = sinks.float().view(1, nkv, g).expand(bs, nkv, g)  # [bs, kvh, g]
    denom = torch.ones(bs, nkv, g, device=q.device)  # [bs, kvh, g]
    acc = torch.zeros(bs, nkv, g, hd, device=q.device)  # [bs, kvh, g, hd]
    view = pool_view(kv)  # [2, kvh, N + 1, ps, hd]
    for c0 in range(0, pages.shape[1], chunk):
        part = view[:, :, pages[:, c0:c0 + chunk], offs[:, c0:c0 + chunk]].float()
        # part: [2, kvh, bs, C, hd]
        s = torch.einsum("bkgd,kbcd->bkgc", qg, part[0]) * scale  # [bs, kvh, g, C]
        s = s + bias[:, :, None, c0:c0 + chunk]  # s: [bs, kvh, g, C]
        new_max = torch.maximum(run_max, s.amax(-1))  # [bs, kvh, g]; finite (sink)
        corr = torch.exp(run_max - new_max)  # [bs, kvh, g]
        p = torch.exp(s - new_max[..., None])  # [bs, kvh, g, C]
        denom = denom * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.einsum("bkgc,kbcd->bkgd", p, part[1])  # [bs,kvh,g,hd]
        run_max = new_max
    return (acc / denom[..., None]).reshape(bs, nh * hd).to(q.dtype)


def mask_bias(visible: torch.Tensor) -> torch.Tensor:
    """bool (True = visible) -> float32 additive bias (0 / -inf), same shape."""
    zero = torch.zeros((), dtype=torch.float32, device=visible.device)
    return zero.masked_fill(~visible, float("-inf"))


class DecodeAttention:
    """One decode step for `bs` requests (one new token each) over the pools.

    Built once per step; its index tensors are shared by all layers. Shapes depend only on
    (bs, table width), so the whole step can be captured in a CUDA graph.
    """

    def __init__(self, pools: KVPools, window: int, positions: torch.Tensor,
                 full_table: torch.Tensor, swa_table: torch.Tensor,
                 scale: float | None = None, groups: QueryGroups | None = None) -> None:
        """positions: [bs] i64; full_table: [bs, max_pages] (0-padded); swa_table:
        [bs, R] holds SWA page `i` at column `i % R` (a ring: R >= cdiv(window, page_size) + 1
        keeps the window's pages apart; a plain table at least as wide as the full one is the
        case where `i % R == i`). Tables are i32 or i64. `scale`: the softmax scale (default
        head_dim ** -0.5; Gemma's query_pre_attn_scalar sets another)."""
        ps = pools.page_size
        self.pools = pools
        bs, width = full_table.shape
        ring = swa_table.shape[1]
        rows = torch.arange(bs, device=positions.device)[:, None]  # [bs, 1]
        last = (positions // ps)[:, None]  # [bs, 1]
        self.full_w_page = full_table.gather(1, last)[:, 0]  # [bs]
        self.swa_w_page = swa_table.gather(1, last % ring)[:, 0]  # [bs]
        self.w_off = positions % ps  # [bs]
        kpos = torch.arange(width * ps, device=positions.device)  # [L]
        self.full_pages = full_table[:, kpos // ps]  # [bs, L]
        self.full_offs = (kpos % ps).expand(bs, -1)  # [bs, L]
        self.full_bias = mask_bias(kpos[None, :] <= positions[:, None])[:, None]  # [bs,1,L]
        # spos: [bs, W + 1] key positions p - window .. p (negative = before the sequence)
        spos = positions[:, None] - window + torch.arange(window + 1, device=positions.device)
        sclamped = spos.clamp(min=0)  # spos/sclamped: [bs, W + 1]
        self.swa_pages = swa_table[rows, (sclamped // ps) % ring]  # [bs, W + 1]
        self.swa_offs = sclamped % ps  # [bs, W + 1]
        self.swa_bias = mask_bias(spos >= 0)[:, None]  # [bs, 1, W + 1]
        self.scale = scale or pools.spec.head_dim ** -0.5
        self.grouped = (GroupedKeys(pools, window, positions, full_table, swa_table, groups)
                        if groups is not None and groups.max_len > 1 else None)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor) -> torch.Tensor:
        """q: [bs, heads, hd]; k, v: [bs, kvh, hd] -> [bs, heads * hd]. Writes k/v first."""
        pool, _ = self.pools.layer_slot(layer)
        kv = self.pools.layer_tensor(layer)  # [N + 1, 2, ps, kvh, hd]
        if pool == "full":
            w_page, pages, offs, bias = (self.full_w_page, self.full_pages, self.full_offs,
                                         self.full_bias)
        else:
            w_page, pages, offs, bias = (self.swa_w_page, self.swa_pages, self.swa_offs,
                                         self.swa_bias)
        kv[w_page, :, self.w_off] = torch.stack((k, v), dim=1).to(kv.dtype)  # [bs, 2, kvh, hd]
        per_key = kv[0].numel() // self.pools.page_size  # K and V elements of one key
        if self.grouped is not None and self.grouped.fits(pool, per_key):
            return self.grouped(pool, kv, q, sinks, self.scale)  # a request's keys read once
        bs, num_keys = pages.shape
        chunk = max(1, DECODE_KV_BUDGET // (bs * per_key))
        if num_keys > chunk:
            return attend_split(q, kv, pages, offs, bias, sinks, self.scale, chunk)
        both = pool_view(kv)[:, :, pages, offs]  # [2, kvh, bs, L, hd]
        out = attend(q[:, None], both[0], both[1], bias, sinks, self.scale)  # [bs, 1, nh*hd]
        return out[:, 0].to(q.dtype)


class PrefillAttention:
    """Positions [start, start + T) of one request; the KV of [0, start) is read from the pools.

    New K/V go to the full pool for every position and to the SWA pool where the SWA page id is
    not 0 (page 0 = not held: the write lands on the dummy page). Attention over the new tokens
    uses the freshly computed K/V directly, so un-held SWA pages never need to be read back.
    """

    def __init__(self, pools: KVPools, window: int, start: int, num_new: int,
                 full_table: torch.Tensor, swa_table: torch.Tensor,
                 scale: float | None = None) -> None:
        """full_table / swa_table: [num_pages] i64 covering [0, start + num_new); `scale` as
        `DecodeAttention`'s."""
        ps, dev = pools.page_size, full_table.device
        self.pools, self.window, self.start = pools, window, start
        pos = torch.arange(start, start + num_new, device=dev)  # [T]
        self.qpos = pos
        self.full_w = (full_table[pos // ps], pos % ps)  # ([T], [T])
        self.swa_w = (swa_table[pos // ps], pos % ps)  # ([T], [T]); page 0 = not held
        self.full_prev = torch.arange(start, device=dev)  # [P] cached positions, full layers
        swa_from = max(0, start - window)
        self.swa_prev = torch.arange(swa_from, start, device=dev)  # [<= W] cached, SWA layers
        self.full_r = (full_table[self.full_prev // ps], self.full_prev % ps)
        self.swa_r = (swa_table[self.swa_prev // ps], self.swa_prev % ps)
        self.scale = scale or pools.spec.head_dim ** -0.5

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, hd]; k, v: [T, kvh, hd] -> [T, heads * hd]."""
        pool, _ = self.pools.layer_slot(layer)
        kv = self.pools.layer_tensor(layer)  # [N + 1, 2, ps, kvh, hd]
        (w_page, w_off), (r_page, r_off), prev = (
            (self.full_w, self.full_r, self.full_prev) if pool == "full"
            else (self.swa_w, self.swa_r, self.swa_prev))
        new = torch.stack((k, v), dim=1)  # [T, 2, kvh, hd]
        cached = pool_view(kv)[:, :, r_page, r_off].to(k.dtype)  # [2, kvh, P, hd]
        both = torch.cat((cached, new.permute(1, 2, 0, 3)), dim=2)  # [2, kvh, P + T, hd]
        kv[w_page, :, w_off] = new.to(kv.dtype)
        kpos = torch.cat((prev, self.qpos))  # [P + T], consecutive positions from first
        first = self.start - prev.shape[0]
        chunk = min(512, max(16, SCORE_BUDGET // (q.shape[1] * kpos.shape[0])))
        outs = []
        for c0 in range(0, q.shape[0], chunk):
            q_lo, q_hi = self.start + c0, min(self.start + c0 + chunk, self.start + q.shape[0])
            # keys this chunk can see: [q_lo - window, q_hi) on SWA layers, [0, q_hi) on full
            k_lo = max(0, q_lo - self.window - first) if pool == "swa" else 0
            k_hi = q_hi - first
            qpos, kp = self.qpos[c0:c0 + chunk], kpos[k_lo:k_hi]  # [C], [K]
            visible = kp[None, :] <= qpos[:, None]  # [C, K]
            if pool == "swa":
                visible &= kp[None, :] >= qpos[:, None] - self.window
            qc = q[c0:c0 + chunk][None]  # [1, C, heads, hd]
            bias = mask_bias(visible)[None]  # [1, C, K]
            kc, vc = both[0, :, None, k_lo:k_hi], both[1, :, None, k_lo:k_hi]  # [kvh, 1, K, hd]
            outs.append(attend(qc, kc, vc, bias, sinks, self.scale)[0])
        return torch.cat(outs)  # [T, heads * hd]


class GroupedKeys:
    """A verify step's attention on the torch path: the entries of one request (its group of
    `1 + k` consecutive queries, `QueryGroups`) share one gather of its keys, each query
    masked to its own position (and window); groups of one are groups too. What the Triton
    path's grouped kernel computes, per group instead of per entry."""

    def __init__(self, pools: KVPools, window: int, positions: torch.Tensor,
                 full_table: torch.Tensor, swa_table: torch.Tensor, groups: QueryGroups) -> None:
        ps, dev = pools.page_size, positions.device
        first = groups.first  # [bs]
        bs = len(first)
        starts = torch.nonzero(first == torch.arange(bs, device=dev))[:, 0]  # [G]
        qn = groups.max_len
        idx = starts[:, None] + torch.arange(qn, device=dev)  # [G, Q] entry of each query
        valid = (idx < bs) & (first[idx.clamp(max=bs - 1)] == starts[:, None])  # [G, Q]
        self.idx, self.valid = idx.clamp(max=bs - 1), valid
        qpos = positions[self.idx]  # [G, Q]
        width, ring = full_table.shape[1], swa_table.shape[1]
        kpos = torch.arange(width * ps, device=dev)  # [L]
        table = full_table[starts]  # [G, width]
        self.full_pages = table[:, kpos // ps]  # [G, L]
        self.full_offs = (kpos % ps).expand(len(starts), -1)  # [G, L]
        self.full_bias = mask_bias((kpos[None, None] <= qpos[..., None])
                                   & valid[..., None])  # [G, Q, L]
        # keys p0 - window .. p0 + Q - 1 cover every query's window [p - window, p]
        spos = positions[starts][:, None] - window + torch.arange(window + qn, device=dev)
        sclamped = spos.clamp(min=0)  # [G, W + Q]
        self.swa_pages = swa_table[starts][torch.arange(len(starts), device=dev)[:, None],
                                           (sclamped // ps) % ring]  # [G, W + Q]
        self.swa_offs = sclamped % ps  # [G, W + Q]
        see = ((spos[:, None] >= 0) & (spos[:, None] <= qpos[..., None])
               & (spos[:, None] >= qpos[..., None] - window) & valid[..., None])
        self.swa_bias = mask_bias(see)  # [G, Q, W + Q]

    def fits(self, pool: str, per_key: int) -> bool:
        """Its gather of `pool` stays within `DECODE_KV_BUDGET` (else the per-entry path,
        which splits long contexts into chunks, runs)."""
        pages = self.full_pages if pool == "full" else self.swa_pages
        return pages.numel() * per_key <= DECODE_KV_BUDGET

    def __call__(self, pool: str, kv: torch.Tensor, q: torch.Tensor, sinks: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q: [bs, heads, hd] -> [bs, heads * hd], the K/V of every entry written before."""
        if pool == "full":
            pages, offs, bias = self.full_pages, self.full_offs, self.full_bias
        else:
            pages, offs, bias = self.swa_pages, self.swa_offs, self.swa_bias
        both = pool_view(kv)[:, :, pages, offs]  # [2, kvh, G, L, hd]
        out = attend(q[self.idx], both[0], both[1], bias, sinks, scale)  # [G, Q, nh * hd]
        res = torch.empty(q.shape[0], out.shape[-1], dtype=q.dtype, device=q.device)
        res[self.idx[self.valid]] = out[self.valid]
        return res
