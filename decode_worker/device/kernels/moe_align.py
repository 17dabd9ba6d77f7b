"""Top-k routing and the (token, expert) pairs sorted by expert, in one Triton program.

`T` tokens choose `k` experts each: pair `p = t * k + j` is token t's j-th choice. The GEMM
kernels walk the pairs in blocks of `BM` rows of one expert, so each expert's pairs are laid out
contiguously and padded to a multiple of BM:

    sorted_ids  [max_blocks * BM] i32   pair ids; padding rows hold T * k (the sentinel)
    expert_ids  [max_blocks]      i32   the expert of each block; -1 past the last used block

    expert 0: p p p . | expert 2: p p p p | p . . . | expert 3: p . . . | -1 -1 ...
              <- BM ->

Sizes are static for a given (T, k, E, BM) (`max_blocks`), so a CUDA graph holds the launch and
no host sync happens. Every entry of `sorted_ids` below the used blocks is written exactly once
(by the pass that places pairs, or by the padding pass, on disjoint positions); entries past the
used blocks are never read (their block's expert is -1).

Routing matches the torch path: the k largest logits (ties to the lower expert index), softmax over
those k in float32 (gpt-oss; and Qwen3-MoE's softmax-then-top-k renormalised, the same weights);
with RENORM off, Qwen3-MoE's `norm_topk_prob` false: each weight over the softmax of every expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def max_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Most blocks `num_tokens * top_k` pairs can need: each hit expert wastes < BM rows."""
    pairs = num_tokens * top_k
    return min(pairs, (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)


@dataclass(frozen=True, slots=True)
class Routing:
    """One MoE call's routing: see the module docstring for the layouts."""

    topk_ids: torch.Tensor  # [T, k] i32
    topk_w: torch.Tensor  # [T, k] f32
    sorted_ids: torch.Tensor  # [max_blocks * BM] i32
    expert_ids: torch.Tensor  # [max_blocks] i32
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.expert_ids.shape[0]


@triton.jit
def _top_k(logits_ptr, stride_t, toks, t_ok, num_experts,
           K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BT: tl.constexpr,
           RENORM: tl.constexpr):
    """Rows `toks` [BT] -> (ids [BT, K_P2] i32, weights [BT, K_P2] f32, chosen [BT, E_P2] i32,
    slot [BT, E_P2] i32: which choice j picked expert e)."""
    ecols = tl.arange(0, E_P2)
    kcols = tl.arange(0, K_P2)
    e_ok = ecols < num_experts
    lg = tl.load(logits_ptr + toks[:, None] * stride_t + ecols[None, :],
                 mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    # padded columns never win; rows past T route to finite values, then count for nothing
    lg = tl.where(e_ok[None, :], lg, float("-inf"))
    # every expert's softmax denominator (for RENORM off), before the loop masks the chosen
    den_all = tl.sum(tl.exp(lg - tl.max(lg, axis=1)[:, None]), axis=1)  # [BT]
    vals = tl.full([BT, K_P2], float("-inf"), tl.float32)
    ids = tl.zeros([BT, K_P2], tl.int32)
    chosen = tl.zeros([BT, E_P2], tl.int32)
    slot = tl.zeros([BT, E_P2], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(lg, axis=1)  # [BT]
        pick = tl.argmax(lg, axis=1).to(tl.int32)  # [BT], first index among ties
        hit = ecols[None, :] == pick[:, None]  # [BT, E_P2]
        vals = tl.where(kcols[None, :] == j, best[:, None], vals)
        ids = tl.where(kcols[None, :] == j, pick[:, None], ids)
        chosen = tl.where(hit, 1, chosen)
        slot = tl.where(hit, j, slot)
        lg = tl.where(hit, float("-inf"), lg)
    chosen = tl.where(t_ok[:, None], chosen, 0)
    w = tl.exp(vals - tl.max(vals, axis=1)[:, None])  # [BT, K_P2]; -inf columns -> 0
    if RENORM:  # noqa: SIM108 (a constexpr branch of a Triton function)
        w = w / tl.sum(w, axis=1)[:, None]
    else:
        w = w / den_all[:, None]  # the top logit is the max over every expert too
    return ids, w, chosen, slot


@triton.jit
def _label_blocks(sorted_ptr, expert_ptr, counts, starts, ends, num_blocks, sentinel,
                  E_P2: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr):
    """Each block's expert (-1 past the used ones) and the sentinel into every padding row;
    the rows of real pairs are left to the placing pass."""
    ecols = tl.arange(0, E_P2)
    used = tl.sum(ends - starts, axis=0)
    for p0 in range(0, num_blocks * BM, BP):
        pos = p0 + tl.arange(0, BP)  # [BP]
        owner = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), axis=1)  # [BP]
        own = ecols[None, :] == owner[:, None]  # [BP, E_P2]
        rank = pos - tl.sum(tl.where(own, starts[None, :], 0), axis=1)
        is_pad = (pos < used) & (rank >= tl.sum(tl.where(own, counts[None, :], 0), axis=1))
        tl.store(sorted_ptr + pos, sentinel, mask=is_pad)
        is_head = (pos % BM == 0) & (pos < num_blocks * BM)
        tl.store(expert_ptr + pos // BM, tl.where(pos < used, owner, -1), mask=is_head)


@triton.jit
def _route_align_kernel(logits_ptr, stride_t, ids_ptr, w_ptr, sorted_ptr, expert_ptr,
                        num_tokens, num_experts, num_blocks,
                        K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
                        BT: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr,
                        RENORM: tl.constexpr):
    """grid (1,): one program routes every token and lays out the pairs (module docstring)."""
    # pass 1: pairs per expert
    counts = tl.zeros([E_P2], tl.int32)
    for t0 in range(0, num_tokens, BT):
        toks = t0 + tl.arange(0, BT)
        _, _, chosen, _ = _top_k(logits_ptr, stride_t, toks, toks < num_tokens, num_experts,
                                 K, K_P2, E_P2, BT, RENORM)
        counts += tl.sum(chosen, axis=0)
    padded = (counts + BM - 1) // BM * BM  # [E_P2]
    ends = tl.cumsum(padded, axis=0)  # [E_P2] inclusive
    starts = ends - padded
    _label_blocks(sorted_ptr, expert_ptr, counts, starts, ends, num_blocks, num_tokens * K,
                  E_P2, BM, BP)
    # pass 2: route again (same data, same result), write the choices and place each pair
    kcols = tl.arange(0, K_P2)
    placed = tl.zeros([E_P2], tl.int32)
    for t0 in range(0, num_tokens, BT):
        toks = t0 + tl.arange(0, BT)
        t_ok = toks < num_tokens
        ids, w, chosen, slot = _top_k(logits_ptr, stride_t, toks, t_ok, num_experts,
                                      K, K_P2, E_P2, BT, RENORM)
        out = toks[:, None] * K + kcols[None, :]  # [BT, K_P2]
        k_ok = t_ok[:, None] & (kcols < K)[None, :]
        tl.store(ids_ptr + out, ids, mask=k_ok)
        tl.store(w_ptr + out, w, mask=k_ok)
        rank = tl.cumsum(chosen, axis=0) - chosen  # [BT, E_P2] earlier tokens of this chunk
        dest = (starts + placed)[None, :] + rank
        tl.store(sorted_ptr + dest, toks[:, None] * K + slot, mask=chosen != 0)
        placed += tl.sum(chosen, axis=0)


def route_and_align(router_logits: torch.Tensor, top_k: int, block_m: int,
                    renormalize: bool = True) -> Routing:
    """router_logits [T, E] (any float dtype) -> the routing of `T * top_k` pairs in blocks of
    `block_m` (`renormalize` False: weights over every expert's softmax). One kernel launch, no
    host sync (graph-capturable)."""
    num_tokens, num_experts = router_logits.shape
    dev = router_logits.device
    blocks = max_blocks(num_tokens, top_k, num_experts, block_m)
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)  # [T, k]
    topk_w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)  # [T, k]
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)  # [blocks * BM]
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=dev)  # [blocks]
    e_p2 = triton.next_power_of_2(num_experts)
    bt = max(16, min(64, 4096 // e_p2, triton.next_power_of_2(num_tokens)))
    _route_align_kernel[(1,)](
        router_logits, router_logits.stride(0), topk_ids, topk_w, sorted_ids, expert_ids,
        num_tokens, num_experts, blocks,
        K=top_k, K_P2=triton.next_power_of_2(top_k), E_P2=e_p2, BT=bt, BM=block_m,
        BP=max(16, min(128, 4096 // e_p2)), RENORM=renormalize, num_warps=4)
    return Routing(topk_ids, topk_w, sorted_ids, expert_ids, block_m)
