"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, and routed experts in the layers
`decoder_sparse_step` picks that `mlp_only_layers` does not name (the others are dense).
Routing: softmax over every expert in float32, the top `num_experts_per_tok`, renormalised when
`norm_topk_prob`; experts are SiLU-gated, stored per expert on the hub."""

from __future__ import annotations

from typing import Any

from decode_worker.device.model.arch import ModelConfig, MoeSpec
from decode_worker.device.model.families.common import Family, Fields
from decode_worker.device.model.families.qwen3 import READS as QWEN3_READS
from decode_worker.device.model.families.qwen3 import qwen3_fields

READS = (*QWEN3_READS, "num_experts", "num_experts_per_tok", "moe_intermediate_size",
         "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def read_config(raw: dict[str, Any], source: str) -> ModelConfig:
    f = Fields(raw, source)
    fields = qwen3_fields(f, "qwen3_moe")
    # transformers 5 writes `num_local_experts`; the hub's configs say `num_experts`
    key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    experts = f.integer(key)
    step = f.integer("decoder_sparse_step", 1)
    dense = set(f.int_list("mlp_only_layers"))
    sparse = tuple(i for i in range(fields["num_hidden_layers"])
                   if i not in dense and (i + 1) % step == 0)
    fields["moe"] = MoeSpec("softmax_topk", experts, f.integer("num_experts_per_tok"),
                            f.integer("moe_intermediate_size"), sparse,
                            norm_topk_prob=f.flag("norm_topk_prob", False))
    if len(sparse) == fields["num_hidden_layers"]:  # no dense layer: the field is not needed
        fields["intermediate_size"] = f.integer("intermediate_size", 1)
    cfg = ModelConfig(**fields)
    cfg.check(source)
    return cfg


def tiny_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Qwen3-MoE in the hub's keys: 8 experts, top 2, renormalised; layer 1 dense
    (`mlp_only_layers`), so both MLP kinds run."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "max_position_embeddings": 4096, "attention_bias": False, "hidden_act": "silu",
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 3, "torch_dtype": "float32", "initializer_range": 0.02}


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), READS, read_config,
                tiny_config, "Qwen/Qwen3-30B-A3B", "full pool only (+ SWA with use_sliding_window)",
                ("torch", "triton attention", "triton MoE (SiLU experts)"))
