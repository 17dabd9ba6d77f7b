"""Llama 3.x (`LlamaForCausalLM`): RMSNorm, GQA without biases, SwiGLU MLP, RoPE with Llama 3's
frequency scaling (`rope_scaling.rope_type` llama3) or none. Every layer attends to the whole
context: no SWA pool."""

from __future__ import annotations

from typing import Any

from decode_worker.device.model.arch import FULL, ModelConfig
from decode_worker.device.model.families.common import Family, Fields
from decode_worker.device.model.rope import read_rope

READS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
         "rope_theta", "rope_scaling | rope_parameters", "attention_bias", "hidden_act",
         "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
         "quantization_config (fp8)")


def dense_fields(f: Fields, family: str, layer_types: list[str] | None = None
                 ) -> dict[str, Any]:
    """The fields Llama-like configs share (Llama, Qwen3, Qwen3-MoE): shapes, norm, RoPE,
    dtype; `layer_types` defaults to every layer full."""
    layers = f.integer("num_hidden_layers")
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    types = f.layer_types(layer_types or [FULL] * layers)
    f.expect("hidden_act", ("silu",), "silu")
    f.expect("mlp_bias", (False,), False)
    return dict(
        family=family, model_type=str(f.raw.get("model_type")),
        vocab_size=f.integer("vocab_size"), hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size"), num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=f.integer("num_key_value_heads", heads),
        head_dim=f.integer("head_dim", hidden // heads), layer_types=types,
        rope=read_rope(f.raw, types, f.number("rope_theta", 10000.0), f.source),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        attention_bias=f.flag("attention_bias", False),
        max_position_embeddings=f.integer("max_position_embeddings", 2048),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        eos_token_ids=f.eos_ids(), torch_dtype=f.torch_dtype(), fp8_block=f.fp8_block())


def read_config(raw: dict[str, Any], source: str) -> ModelConfig:
    cfg = ModelConfig(**dense_fields(Fields(raw, source), "llama"))
    cfg.check(source)
    return cfg


def tiny_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Llama 3.1 in the hub's keys (rope_theta, rope_scaling llama3, torch_dtype)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        "max_position_embeddings": 4096, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "initializer_range": 0.02}


FAMILY = Family("llama", ("LlamaForCausalLM",), ("llama",), READS, read_config, tiny_config,
                "meta-llama/Llama-3.1-8B-Instruct")
