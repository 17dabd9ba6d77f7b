"""gpt-oss (`GptOssForCausalLM`), kept as it was built: alternating sliding / full layers with
attention sinks, YaRN RoPE, MXFP4 experts with a biased top-k router and clamped SwiGLU
(device/model/config.py, gpt_oss.py, weights.py)."""

from __future__ import annotations

from typing import Any

from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.families.common import Family

READS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
         "num_experts_per_tok", "sliding_window", "layer_types", "rope_theta",
         "rope_scaling | rope_parameters (yarn)", "swiglu_limit", "rms_norm_eps",
         "max_position_embeddings", "eos_token_id")


def read_config(raw: dict[str, Any], source: str) -> GptOssConfig:
    return GptOssConfig.from_dict(raw, source)


def tiny_config(vocab_size: int) -> dict[str, Any]:
    from decode_worker.device.default_model import tiny_config as gpt_oss_tiny

    return gpt_oss_tiny(vocab_size=vocab_size)


FAMILY = Family("gpt-oss", ("GptOssForCausalLM",), ("gpt_oss",), READS, read_config,
                tiny_config, "openai/gpt-oss-120b", "full + SWA pools (1:1)",
                ("torch", "triton attention", "triton MoE (MXFP4)"))
