"""The parts every family's forward pass is built from, written once: RMSNorm (plain and
Gemma's `1 + weight`), rotary embedding, the gated MLP activations, the two MoE routings and
the routed experts (three equivalent torch strategies).

Expert weights are in matmul orientation: gate_up [E, H, 2I] with [gate | up] columns and down
[E, I, H] (views of the checkpoint's [E, 2I, H] / [E, H, I] are fine: only strides differ).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

Act = Callable[[torch.Tensor], torch.Tensor]
L = TypeVar("L")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             offset: float = 0.0) -> torch.Tensor:
    """RMSNorm in float32, scaled by `weight` (by `offset + weight` for Gemma's norms, in
    float32 as transformers does), cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight.float() + offset if offset else weight
    return (scale * xf).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head: x [T, n, hd], cos/sin [T, 1, hd/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, 1, hd/2] in `dtype` (angles in float32, as the
    reference computes them)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2] f32
    cos = (freqs.cos() * scale).to(dtype)[:, None, :]  # [T, 1, hd/2]
    sin = (freqs.sin() * scale).to(dtype)[:, None, :]  # [T, 1, hd/2]
    return cos, sin


def gated(kind: str) -> Act:
    """[..., 2I] laid out [gate | up] -> act(gate) * up [..., I]: SiLU (SwiGLU: Llama, Qwen)
    or tanh-approximated GELU (GeGLU: Gemma's gelu_pytorch_tanh)."""
    if kind == "silu":
        return _silu_gated
    if kind == "gelu_tanh":
        return _gelu_tanh_gated
    raise ValueError(f"unknown activation {kind!r}")


def _silu_gated(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_tanh_gated(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def dense_mlp(x: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor,
              act: Act) -> torch.Tensor:
    """x [T, H] -> [T, H]; gate_up_w [2I, H] ([gate; up] rows), down_w [H, I]."""
    return F.linear(act(F.linear(x, gate_up_w)), down_w)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's routing: softmax over all experts in float32, the top k, renormalised to
    sum 1 when `renormalize` (norm_topk_prob). [T, E] -> (ids [T, k], weights [T, k] in the
    logits' dtype)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    top_v, top_i = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    return top_i, top_v.to(router_logits.dtype)


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top k logits, softmaxed among themselves. [T, E] -> (ids, w)."""
    top_v, top_i = torch.topk(router_logits, top_k, dim=-1)  # [T, k]
    return top_i, torch.softmax(top_v, dim=-1)


def routed_experts(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, act: Act, *,
                   gate_up_b: torch.Tensor | None = None, down_b: torch.Tensor | None = None,
                   static: bool = False) -> torch.Tensor:
    """sum_k top_w * (act(x @ gate_up[e] + b) @ down[e] + b) over each token's experts:
    x [T, H] -> [T, H]. Three equivalent strategies: per-token weight gather when few
    (token, expert) pairs exist, every expert on every token when that is cheaper or shapes
    must be static (CUDA graphs), and a loop over the hit experts for large eager batches."""
    num_tokens, top_k = top_i.shape
    num_experts = gate_up.shape[0]
    if num_tokens * top_k < num_experts:
        return expert_gather(x, top_i, top_w, gate_up, down, act, gate_up_b, down_b)
    if static or num_experts <= 16:
        return expert_dense(x, top_i, top_w, gate_up, down, act, gate_up_b, down_b)
    return expert_loop(x, top_i, top_w, gate_up, down, act, gate_up_b, down_b)


Bias = torch.Tensor | None


def expert_gather(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, act: Act,
                  gu_b: Bias, d_b: Bias) -> torch.Tensor:
    gu = torch.einsum("th,tkhi->tki", x, gate_up[top_i])  # [T, k, 2I]
    if gu_b is not None:
        gu = gu + gu_b[top_i]
    out = torch.einsum("tki,tkih->tkh", act(gu), down[top_i])  # [T, k, H]
    if d_b is not None:
        out = out + d_b[top_i]
    return (out * top_w[..., None].to(out.dtype)).sum(1)  # [T, H]


def expert_dense(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, act: Act,
                 gu_b: Bias, d_b: Bias) -> torch.Tensor:
    num_experts = gate_up.shape[0]
    xe = x.unsqueeze(0).expand(num_experts, -1, -1)  # [E, T, H]
    gu = (torch.baddbmm(gu_b[:, None, :], xe, gate_up) if gu_b is not None
          else torch.bmm(xe, gate_up))  # [E, T, 2I]
    a = act(gu)  # [E, T, I]
    out = torch.baddbmm(d_b[:, None, :], a, down) if d_b is not None else torch.bmm(a, down)
    dense_w = torch.zeros(x.shape[0], num_experts, dtype=out.dtype, device=x.device)
    dense_w.scatter_(1, top_i, top_w.to(out.dtype))  # dense_w: [T, E]
    return torch.einsum("eth,te->th", out, dense_w)  # [T, H]


def expert_loop(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: Act,
                gu_b: Bias, d_b: Bias) -> torch.Tensor:
    y = torch.zeros_like(x)  # [T, H]
    for e in torch.unique(top_i).tolist():
        tok, slot = torch.where(top_i == e)  # [n], [n]
        gu = x[tok] @ gate_up[e]  # [n, 2I]
        if gu_b is not None:
            gu = gu + gu_b[e]
        out = act(gu) @ down[e]  # [n, H]
        if d_b is not None:
            out = out + d_b[e]
        y.index_add_(0, tok, out * top_w[tok, slot, None].to(out.dtype))
    return y


def weights_bytes(embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor,
                  layers: Iterable[object]) -> int:
    """Bytes of every distinct tensor a model holds: the embedding, final norm and head, and
    each layer's tensor fields (a view, e.g. a tied lm_head, counts once with its base; meta
    tensors count what they would take)."""
    tensors: dict[int, torch.Tensor] = {}
    every = [embed, norm, lm_head]
    for lw in layers:
        every += [t for f in fields(lw)  # type: ignore[arg-type]
                  if isinstance(t := getattr(lw, f.name), torch.Tensor)]
    for t in every:
        base = t._base if t._base is not None else t
        tensors[id(base)] = base
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ModelWeights(Generic[L]):
    """What every family's model derives from its weights: the device, dtype and bytes."""

    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    layers: list[L]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def weights_bytes(self) -> int:
        """Bytes of every distinct tensor the model holds (a tied lm_head counts once; meta
        tensors count what they would take)."""
        return weights_bytes(self.embed, self.norm, self.lm_head, self.layers)
