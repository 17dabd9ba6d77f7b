"""The decoder forward pass shared by the grouped-query families (Llama 3, Qwen3, Qwen3-MoE,
Gemma 3), over flat token batches; attention is supplied by the caller (`Attend`).

Per layer, as transformers computes each family (the switches come from `ModelConfig`):

    x = norm(h)                                   input_layernorm
    q, k, v = x @ Wq, Wk, Wv (+ bias)             per-head RMSNorm of q and k when qk_norm
    q, k = rope(q), rope(k)                       the layer type's RoPE (Gemma: local / global)
    o = attend(q, k, v) @ Wo (+ bias)             scale = query_pre_attn_scalar ** -0.5 or hd
    plain:     h += o;        h += mlp(norm(h))                     post_attention_layernorm
    sandwich:  h += norm(o);  h += norm(mlp(norm(h)))   Gemma's post-attn, pre- / post-FFN norms
    mlp: act(x @ W_gate) * (x @ W_up) @ W_down, or routed experts (softmax top-k, Qwen3-MoE)

The model has no attention sinks: `attend` gets a sink logit of -1e30 per head, whose exp term
is 0 in float32 (a finite value, so an all-masked key chunk never makes NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decode_worker.device.model import layers
from decode_worker.device.model.arch import ModelConfig
from decode_worker.device.model.gpt_oss import Attend
from decode_worker.device.model.rope import inv_freq

NO_SINK = -1e30


@dataclass(slots=True)
class DecoderLayer:
    """One decoder layer's weights (Linear orientation [out, in] unless noted)."""

    input_norm: torch.Tensor  # [H]
    post_attn_norm: torch.Tensor  # [H]
    qkv_w: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, H]
    o_w: torch.Tensor  # [H, heads * head_dim]
    qkv_b: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    o_b: torch.Tensor | None = None  # [H]
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    pre_ffn_norm: torch.Tensor | None = None  # [H] (Gemma)
    post_ffn_norm: torch.Tensor | None = None  # [H] (Gemma)
    gate_up_w: torch.Tensor | None = None  # dense MLP: [2I, H], [gate; up] rows
    down_w: torch.Tensor | None = None  # dense MLP: [H, I]
    router_w: torch.Tensor | None = None  # MoE: [E, H]
    experts_gate_up: torch.Tensor | None = None  # MoE: [E, H, 2I] ([gate | up] columns)
    experts_down: torch.Tensor | None = None  # MoE: [E, I, H]


@dataclass(slots=True)
class ExpertView:
    """One MoE layer's experts as the fused Triton MoE reads them (kernels/fused_moe.py,
    dense form): the checkpoint's weights as [E, H, 2I] / [E, I, H] views, zero biases."""

    gate_up: torch.Tensor  # [E, H, 2I]
    gate_up_b: torch.Tensor  # [E, 2I] zeros
    down: torch.Tensor  # [E, I, H]
    down_b: torch.Tensor  # [E, H] zeros
    gate_up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None


class DecoderModel(layers.ModelWeights[DecoderLayer]):
    """Weights plus the forward pass; build with `decoder_weights.load_decoder`.

    `moe_backend`: "triton" runs routed experts in the fused Triton MoE (SiLU-gated, routing
    renormalised per `norm_topk_prob`), "torch" in torch ops (`layers.routed_experts`)."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, decoder_layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: torch.Tensor, *, moe_backend: str = "torch") -> None:
        self.cfg = cfg
        self.moe_backend = moe_backend
        self.embed = embed  # [V, H]
        self.layers = decoder_layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H] (the embedding itself when tied)
        dev = embed.device
        self.rope: dict[str, tuple[torch.Tensor, float]] = {}
        for layer_type, spec in cfg.rope.items():
            inv, scale = inv_freq(spec, cfg.head_dim, cfg.max_position_embeddings)
            self.rope[layer_type] = (inv.to(dev), scale)  # inv: [head_dim / 2] f32
        self.no_sinks = torch.full((cfg.num_attention_heads,), NO_SINK, dtype=torch.float32,
                                   device=dev)  # [heads] f32
        # Gemma scales the embedding by sqrt(hidden) rounded to the model dtype
        self.embed_scale = (None if cfg.embed_scale is None
                            else torch.tensor(cfg.embed_scale, dtype=embed.dtype, device=dev))
        self.act = layers.gated(cfg.activation)
        self.experts: dict[int, ExpertView] = {}
        if moe_backend == "triton":
            for i, lw in enumerate(decoder_layers):
                if lw.experts_gate_up is not None and lw.experts_down is not None:
                    gu, dn = lw.experts_gate_up, lw.experts_down
                    self.experts[i] = ExpertView(
                        gu, gu.new_zeros(gu.shape[0], gu.shape[2]), dn,
                        dn.new_zeros(dn.shape[0], dn.shape[2]))  # biases [E, 2I], [E, H]

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                *, static: bool = False) -> torch.Tensor:
        """Hidden states after the final norm: token_ids/positions [T] i64 -> [T, H].
        `static` keeps every op free of data-dependent shapes (CUDA-graph capture)."""
        cfg = self.cfg
        h = self.embed[token_ids]  # h: [T, H]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        rope = {t: layers.rope_cos_sin(positions, inv, scale, self.dtype)
                for t, (inv, scale) in self.rope.items()}  # t -> cos/sin [T, 1, hd / 2]
        for i, lw in enumerate(self.layers):
            x = self._norm(h, lw.input_norm)
            o = F.linear(self._attention(i, x, lw, rope[cfg.layer_types[i]], attend),
                         lw.o_w, lw.o_b)  # o: [T, H]
            if lw.pre_ffn_norm is not None and lw.post_ffn_norm is not None:  # Gemma
                h = h + self._norm(o, lw.post_attn_norm)
                m = self._mlp(i, self._norm(h, lw.pre_ffn_norm), lw, static)
                h = h + self._norm(m, lw.post_ffn_norm)
            else:
                h = h + o
                h = h + self._mlp(i, self._norm(h, lw.post_attn_norm), lw, static)
        return self._norm(h, self.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] float32 (soft-capped when the config sets final_logit_softcapping)."""
        out = F.linear(hidden, self.lm_head).float()  # [N, V]
        cap = self.cfg.final_logit_softcapping
        return out if not cap else torch.tanh(out / cap) * cap

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return layers.rms_norm(x, weight, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def _attention(self, i: int, x: torch.Tensor, lw: DecoderLayer,
                   cos_sin: tuple[torch.Tensor, torch.Tensor], attend: Attend) -> torch.Tensor:
        """x [T, H] -> attention output [T, heads * head_dim] (K/V stored by `attend`)."""
        cfg = self.cfg
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = F.linear(x, lw.qkv_w, lw.qkv_b)  # qkv: [T, (nh + 2 nkv) hd]
        q = qkv[:, :nh * hd].view(-1, nh, hd)  # [T, heads, hd]
        k = qkv[:, nh * hd:(nh + nkv) * hd].view(-1, nkv, hd)  # [T, kv_heads, hd]
        v = qkv[:, (nh + nkv) * hd:].view(-1, nkv, hd)  # [T, kv_heads, hd]
        if lw.q_norm is not None and lw.k_norm is not None:
            q, k = self._norm(q, lw.q_norm), self._norm(k, lw.k_norm)
        cos, sin = cos_sin
        q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
        return attend(i, q, k, v, self.no_sinks)

    def _mlp(self, i: int, x: torch.Tensor, lw: DecoderLayer, static: bool) -> torch.Tensor:
        moe = self.cfg.moe
        if lw.router_w is None or moe is None:
            assert lw.gate_up_w is not None and lw.down_w is not None  # the loader's invariant
            return layers.dense_mlp(x, lw.gate_up_w, lw.down_w, self.act)
        assert lw.experts_gate_up is not None and lw.experts_down is not None
        router = F.linear(x, lw.router_w)  # router: [T, E]
        view = self.experts.get(i)
        if view is not None:
            from decode_worker.device.kernels.fused_moe import fused_moe  # imports triton

            return fused_moe(x, router, view, moe.top_k, 1.0, 0.0, silu=True,
                             renormalize=moe.norm_topk_prob)
        top_i, top_w = layers.softmax_topk(router, moe.top_k, moe.norm_topk_prob)  # [T, k]
        return layers.routed_experts(x, top_i, top_w, lw.experts_gate_up, lw.experts_down,
                                     self.act, static=static)
