"""Qwen3 dense (`Qwen3ForCausalLM`): Llama's layout plus a per-head RMSNorm of q and k before
RoPE; `head_dim` need not be hidden / heads (Qwen3-32B: 5120 / 64 heads, head_dim 128); small
models tie the embedding and the head. Sliding layers only with `use_sliding_window` (layers
from `max_window_layers` on, as transformers reads it)."""

from __future__ import annotations

from typing import Any

from decode_worker.device.model.arch import FULL, SLIDING, ModelConfig
from decode_worker.device.model.families.common import Family, Fields
from decode_worker.device.model.families.llama import READS as LLAMA_READS
from decode_worker.device.model.families.llama import dense_fields

READS = (*LLAMA_READS, "use_sliding_window", "sliding_window", "max_window_layers",
         "layer_types")


def qwen3_fields(f: Fields, family: str) -> dict[str, Any]:
    """Qwen3's fields (shared with Qwen3-MoE): q/k norm, head_dim 128 unless given."""
    layers = f.integer("num_hidden_layers")
    window = f.raw.get("sliding_window") if f.flag("use_sliding_window", False) else None
    if f.raw.get("layer_types") is not None:
        window = f.raw.get("sliding_window")
    start = f.integer("max_window_layers", layers, minimum=0)
    types = [SLIDING if window is not None and i >= start else FULL for i in range(layers)]
    fields = dense_fields(f, family, types)
    sliding = SLIDING in fields["layer_types"]
    # SGLang keeps full KV in every layer of a Qwen model with sliding layers, as for Gemma 3
    fields.update(head_dim=f.integer("head_dim", 128), qk_norm=True,
                  sliding_window=window if sliding else None, sglang_ordinary=sliding)
    return fields


def read_config(raw: dict[str, Any], source: str) -> ModelConfig:
    cfg = ModelConfig(**qwen3_fields(Fields(raw, source), "qwen3"))
    cfg.check(source)
    return cfg


def tiny_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Qwen3 in the hub's keys: head_dim 32 with hidden 64 and 4 heads (head_dim x
    heads != hidden), tied embeddings."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "max_position_embeddings": 4096, "attention_bias": False, "hidden_act": "silu",
        "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 2, "torch_dtype": "float32", "initializer_range": 0.02}


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), READS, read_config, tiny_config,
                "Qwen/Qwen3-32B", "full pool only (+ SWA with use_sliding_window)")
