"""The grouped-query families' tensors as the hub names them, and loading them into a
`DecoderModel`. One naming serves Llama 3, Qwen3, Qwen3-MoE and Gemma 3 (transformers'):

    model.embed_tokens.weight [V, H]            model.norm.weight [H]     lm_head.weight [V, H]
    model.layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight [H]
        (+ Gemma: .pre_feedforward_layernorm.weight, .post_feedforward_layernorm.weight)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias)
        (+ q_norm.weight, k_norm.weight [head_dim] with qk_norm)
    dense MLP:  model.layers.{i}.mlp.{gate,up,down}_proj.weight
    MoE:        model.layers.{i}.mlp.gate.weight [E, H],
                model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight (per expert)

`lm_head.weight` is absent with tied embeddings (the embedding is the head). Multimodal Gemma 3
checkpoints nest the text model (`language_model.model.` or `model.language_model.`): the
prefix is found from where the embedding lies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decode_worker.device.model.arch import ModelConfig
from decode_worker.device.model.checkpoint import Checkpoint
from decode_worker.device.model.decoder import DecoderLayer, DecoderModel

Shapes = dict[str, tuple[int, ...]]
PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def tensor_shapes(cfg: ModelConfig, prefix: str = "model.") -> Shapes:
    """Every tensor of a checkpoint of `cfg`: hub name -> shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: Shapes = {prefix + "embed_tokens.weight": (v, h), prefix + "norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        shapes.update(layer_shapes(cfg, i, f"{prefix}layers.{i}."))
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def layer_shapes(cfg: ModelConfig, i: int, p: str) -> Shapes:
    h, hd = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    a = p + "self_attn."
    out: Shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   a + "q_proj.weight": (nq, h), a + "k_proj.weight": (nkv, h),
                   a + "v_proj.weight": (nkv, h), a + "o_proj.weight": (h, nq)}
    if cfg.attention_bias:
        out.update({a + "q_proj.bias": (nq,), a + "k_proj.bias": (nkv,),
                    a + "v_proj.bias": (nkv,), a + "o_proj.bias": (h,)})
    if cfg.qk_norm:
        out.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
    if cfg.sandwich_norms:
        out.update({p + "pre_feedforward_layernorm.weight": (h,),
                    p + "post_feedforward_layernorm.weight": (h,)})
    m = p + "mlp."
    if cfg.moe is not None and cfg.is_moe_layer(i):
        inter = cfg.moe.intermediate_size
        out[m + "gate.weight"] = (cfg.moe.num_experts, h)
        for e in range(cfg.moe.num_experts):
            x = f"{m}experts.{e}."
            out.update({x + "gate_proj.weight": (inter, h), x + "up_proj.weight": (inter, h),
                        x + "down_proj.weight": (h, inter)})
    else:
        inter = cfg.intermediate_size
        out.update({m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h),
                    m + "down_proj.weight": (h, inter)})
    return out


def find_prefix(ckpt: Checkpoint) -> str:
    """Where the text model's tensors start ("model." for a text-only checkpoint)."""
    for prefix in PREFIXES:
        if prefix + "embed_tokens.weight" in ckpt:
            return prefix
    return PREFIXES[0]  # `get` then names the missing embedding


def load_decoder(cfg: ModelConfig, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype,
                 *, moe_backend: str = "torch") -> DecoderModel:
    """Build the model from the checkpoint's tensors (each checked against the config).
    Raises ConfigError naming a missing tensor, or a tensor and both shapes."""
    prefix = find_prefix(ckpt)
    shapes = tensor_shapes(cfg, prefix)

    def get(name: str) -> torch.Tensor:
        return ckpt.get(name, shapes[name], dtype, device)

    embed = get(prefix + "embed_tokens.weight")  # [V, H]
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")  # [V, H]
    decoder_layers = [_layer(cfg, i, f"{prefix}layers.{i}.", get)
                      for i in range(cfg.num_hidden_layers)]
    return DecoderModel(cfg, embed, decoder_layers, get(prefix + "norm.weight"), lm_head,
                        moe_backend=moe_backend)


def _layer(cfg: ModelConfig, i: int, p: str, get: Callable[[str], torch.Tensor]
           ) -> DecoderLayer:
    a, m = p + "self_attn.", p + "mlp."
    qkv_w = torch.cat([get(f"{a}{n}_proj.weight") for n in "qkv"])  # [(nh + 2 nkv) hd, H]
    lw = DecoderLayer(
        input_norm=get(p + "input_layernorm.weight"),
        post_attn_norm=get(p + "post_attention_layernorm.weight"),
        qkv_w=qkv_w, o_w=get(a + "o_proj.weight"))
    if cfg.attention_bias:
        lw.qkv_b = torch.cat([get(f"{a}{n}_proj.bias") for n in "qkv"])  # [(nh + 2 nkv) hd]
        lw.o_b = get(a + "o_proj.bias")
    if cfg.qk_norm:
        lw.q_norm, lw.k_norm = get(a + "q_norm.weight"), get(a + "k_norm.weight")
    if cfg.sandwich_norms:
        lw.pre_ffn_norm = get(p + "pre_feedforward_layernorm.weight")
        lw.post_ffn_norm = get(p + "post_feedforward_layernorm.weight")
    if cfg.moe is not None and cfg.is_moe_layer(i):
        lw.router_w = get(m + "gate.weight")  # [E, H]
        experts = range(cfg.moe.num_experts)
        gate_up = torch.stack([torch.cat((get(f"{m}experts.{e}.gate_proj.weight"),
                                          get(f"{m}experts.{e}.up_proj.weight")))
                               for e in experts])  # [E, 2I, H]
        down = torch.stack([get(f"{m}experts.{e}.down_proj.weight") for e in experts])
        lw.experts_gate_up = gate_up.transpose(1, 2)  # [E, H, 2I] view
        lw.experts_down = down.transpose(1, 2)  # [E, I, H] view of [E, H, I]
    else:
        lw.gate_up_w = torch.cat((get(m + "gate_proj.weight"), get(m + "up_proj.weight")))
        lw.down_w = get(m + "down_proj.weight")  # [H, I]
    return lw
