"""The gpt-oss forward pass over flat token batches; attention is supplied by the caller.

The model knows nothing about pages: each layer hands its post-RoPE q/k/v to an `Attend`
callable (device/attention.py), which stores the new K/V into the pools and returns the attention
output. Architecture facts (transformers' GptOss): RMSNorm; q/k/v/o with biases; RoPE (YaRN) on
the two halves of each head; attention with a learned per-head sink logit; a top-k router with a
bias whose chosen logits are softmaxed; experts with a clamped SwiGLU
`(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`, `g = clamp(gate, max=l)`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from decode_worker.device.model import layers
from decode_worker.device.model.config import GptOssConfig, rope_inv_freq
from decode_worker.device.model.layers import apply_rope, rms_norm, rope_cos_sin
from decode_worker.errors import ConfigError

__all__ = ["Attend", "GptOssModel", "LayerWeights", "apply_rope", "moe", "rms_norm", "swiglu"]


class Attend(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor
    ) -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        ...


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. Experts are dense (scales None; gate/up columns de-interleaved to
    [gate | up]) or MXFP4 as the checkpoint stores them (scales set; only the Triton MoE reads
    them): gate_up [E, 2I, H / 2] u8 with gate/up rows interleaved (2j gate, 2j + 1 up),
    down [E, H, I / 2] u8. The gate/up bias is [gate | up] in both forms."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    qkv_w: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, H]
    qkv_b: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim]
    o_w: torch.Tensor  # [H, heads * head_dim]
    o_b: torch.Tensor  # [H]
    sinks: torch.Tensor  # [heads] float32
    router_w: torch.Tensor  # [E, H]
    router_b: torch.Tensor  # [E]
    gate_up: torch.Tensor  # dense [E, H, 2I] | MXFP4 blocks [E, 2I, H / 2] u8
    gate_up_b: torch.Tensor  # [E, 2I]
    down: torch.Tensor  # dense [E, I, H] | MXFP4 blocks [E, H, I / 2] u8
    down_b: torch.Tensor  # [E, H]
    gate_up_scales: torch.Tensor | None = None  # MXFP4: [E, 2I, H / 32] u8
    down_scales: torch.Tensor | None = None  # MXFP4: [E, H, I / 32] u8


class GptOssModel(layers.ModelWeights[LayerWeights]):
    """Weights plus the forward pass. Build with `weights.load_model` (or `from_state_dict`).

    `moe_backend`: "triton" runs the routed experts in the fused Triton MoE (any T, eager or
    inside a graph), "torch" in torch ops (`moe`)."""

    def __init__(self, cfg: GptOssConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor, *, moe_backend: str = "torch") -> None:
        self.cfg = cfg
        self.moe_backend = moe_backend
        self.embed = embed  # [V, H]
        self.layers = layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H]
        inv, scale = rope_inv_freq(cfg)
        # inv_freq: [head_dim / 2] f32 (RoPE math is done in float32 like the reference)
        self.inv_freq = torch.tensor(inv, dtype=torch.float32, device=embed.device)
        self.rope_scale = scale

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                *, static: bool = False) -> torch.Tensor:
        """Hidden states after the final norm: token_ids/positions [T] i64 -> [T, H].

        `static` keeps every op free of data-dependent shapes (CUDA-graph capture).
        """
        cfg = self.cfg
        h = self.embed[token_ids]  # h: [T, H]
        cos, sin = self._rope(positions)  # cos/sin: [T, 1, head_dim / 2]
        nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, lw.qkv_w, lw.qkv_b)  # qkv: [T, nq + 2 nkv]
            q = qkv[:, :nq].view(-1, cfg.num_attention_heads, cfg.head_dim)  # [T, heads, hd]
            k = qkv[:, nq:nq + nkv].view(-1, cfg.num_key_value_heads, cfg.head_dim)
            v = qkv[:, nq + nkv:].view(-1, cfg.num_key_value_heads, cfg.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            a = attend(i, q, k, v, lw.sinks)  # a: [T, heads * hd]
            h = h + F.linear(a, lw.o_w, lw.o_b)
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            h = h + moe(x, lw, cfg, static=static, backend=self.moe_backend)
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32."""
        return F.linear(hidden, self.lm_head).float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.rope_scale, self.dtype)


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] laid out [gate | up] -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe(x: torch.Tensor, lw: LayerWeights, cfg: GptOssConfig, *, static: bool,
        backend: str = "torch") -> torch.Tensor:
    """Routed experts: x [T, H] -> [T, H].

    backend "triton": the fused Triton MoE (device/kernels/fused_moe.py), dense or MXFP4 experts,
    graph-capturable. backend "torch", three equivalent strategies over dense experts:
    per-token weight gather when few (token, expert) pairs exist, every expert on every token
    when that is cheaper or shapes must be static (graphs), and a loop over the hit experts (the
    reference's strategy) for large eager batches of many experts. Raises ConfigError for MXFP4
    experts on the torch backend.
    """
    num_tokens, num_experts, top_k = x.shape[0], cfg.num_local_experts, cfg.num_experts_per_tok
    router = F.linear(x, lw.router_w, lw.router_b)  # router: [T, E]
    if backend == "triton":
        from decode_worker.device.kernels.fused_moe import fused_moe  # imports triton

        return fused_moe(x, router, lw, top_k, cfg.swiglu_alpha, cfg.swiglu_limit)
    if lw.gate_up_scales is not None:
        raise ConfigError("MXFP4 experts run only on the Triton MoE (model.moe_backend)")
    top_i, top_w = layers.topk_softmax(router, top_k)  # [T, k] each
    if num_tokens * top_k < num_experts:
        return _moe_gather(x, lw, cfg, top_i, top_w)
    if static or num_experts <= 16:
        return _moe_dense(x, lw, cfg, top_i, top_w)
    return _moe_loop(x, lw, cfg, top_i, top_w)


def _moe_gather(x: torch.Tensor, lw: LayerWeights, cfg: GptOssConfig,
                top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    return layers.expert_gather(x, top_i, top_w, lw.gate_up, lw.down, _act(cfg),
                                lw.gate_up_b, lw.down_b)


def _moe_dense(x: torch.Tensor, lw: LayerWeights, cfg: GptOssConfig,
               top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    return layers.expert_dense(x, top_i, top_w, lw.gate_up, lw.down, _act(cfg),
                               lw.gate_up_b, lw.down_b)


def _moe_loop(x: torch.Tensor, lw: LayerWeights, cfg: GptOssConfig,
              top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    return layers.expert_loop(x, top_i, top_w, lw.gate_up, lw.down, _act(cfg),
                              lw.gate_up_b, lw.down_b)


def _act(cfg: GptOssConfig) -> layers.Act:
    return functools.partial(swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
