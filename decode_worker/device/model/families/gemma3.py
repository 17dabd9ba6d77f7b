"""Gemma 3 text (`Gemma3ForCausalLM`, model_type `gemma3_text`; the text model of a
`gemma3` multimodal checkpoint too). Facts, as transformers' Gemma3Text reads them:

- layer i slides unless (i + 1) % sliding_window_pattern == 0 (6: five local, one global), or
  transformers 5's `layer_types`; HF `sliding_window` counts the query itself;
- RoPE: global layers `rope_theta` (1e6) with `rope_scaling` (27B: linear x8), sliding layers
  `rope_local_base_freq` (1e4) unscaled; or `rope_parameters` keyed by layer type;
- q/k per-head RMSNorm, attention scale `query_pre_attn_scalar ** -0.5`; embeddings times
  sqrt(hidden) rounded to the model dtype; GeGLU with tanh GELU; four norms per layer, each
  multiplying by (1 + weight); tied head; logits soft-capped when `final_logit_softcapping`.

Attention soft-capping (`attn_logit_softcapping`, Gemma 2) and bidirectional attention are not
implemented: a config that sets them is refused at start-up, naming the field.
"""

from __future__ import annotations

from typing import Any

from decode_worker.device.model.arch import FULL, SLIDING, ModelConfig
from decode_worker.device.model.families.common import Family, Fields
from decode_worker.device.model.rope import read_rope
from decode_worker.errors import ConfigError

READS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
         "sliding_window", "sliding_window_pattern | layer_types", "rope_theta",
         "rope_local_base_freq", "rope_scaling | rope_parameters", "query_pre_attn_scalar",
         "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
         "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
         "text_config (gemma3)", "quantization_config (fp8)")


def read_config(raw: dict[str, Any], source: str) -> ModelConfig:
    if raw.get("model_type") == "gemma3":  # the multimodal checkpoint: serve its text model
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: config field 'text_config' is missing")
        raw, source = {"eos_token_id": raw.get("eos_token_id"), **text}, f"{source} text_config"
    f = Fields(raw, source)
    layers = f.integer("num_hidden_layers", 26)
    pattern = f.integer("sliding_window_pattern", 6)
    types = f.layer_types([SLIDING if (i + 1) % pattern else FULL for i in range(layers)])
    f.expect("hidden_activation", ("gelu_pytorch_tanh",), raw.get("hidden_act")
             or "gelu_pytorch_tanh")
    f.expect("attn_logit_softcapping", (None,), None)
    f.expect("use_bidirectional_attention", (False, None), False)
    hidden = f.integer("hidden_size", 2304)
    cfg = ModelConfig(
        family="gemma3", model_type="gemma3_text", vocab_size=f.integer("vocab_size", 262208),
        hidden_size=hidden, intermediate_size=f.integer("intermediate_size", 9216),
        num_hidden_layers=layers, num_attention_heads=f.integer("num_attention_heads", 8),
        num_key_value_heads=f.integer("num_key_value_heads", 4),
        head_dim=f.integer("head_dim", 256), layer_types=types,
        rope=read_rope(raw, types, f.number("rope_theta", 1e6), source,
                       local_key="rope_local_base_freq", local_theta=1e4),
        sliding_window=f.integer("sliding_window", 4096, minimum=2),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6), norm_offset=1.0,
        attention_bias=f.flag("attention_bias", False), qk_norm=True, sandwich_norms=True,
        query_pre_attn_scalar=f.number("query_pre_attn_scalar", 256),
        activation="gelu_tanh", embed_scale=hidden ** 0.5,
        final_logit_softcapping=f.optional_float("final_logit_softcapping"),
        max_position_embeddings=f.integer("max_position_embeddings", 131072),
        tie_word_embeddings=f.flag("tie_word_embeddings", True), eos_token_ids=f.eos_ids(),
        torch_dtype=f.torch_dtype(), fp8_block=f.fp8_block(),
        sglang_ordinary=not f.flag("is_hybrid_swa", False))
    cfg.check(source)
    return cfg


def tiny_config(vocab_size: int) -> dict[str, Any]:
    """A tiny Gemma 3 in the hub's keys: 4 layers with pattern 3 (sliding, sliding, global,
    sliding), HF sliding_window 32 (window 31), query_pre_attn_scalar 24 with head_dim 16,
    linear RoPE scaling on the global layer, logit soft-capping set."""
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "sliding_window": 32,
        "sliding_window_pattern": 3, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": None, "max_position_embeddings": 4096,
        "attention_bias": False, "tie_word_embeddings": True, "torch_dtype": "float32",
        "initializer_range": 0.02, "pad_token_id": 0}


FAMILY = Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                ("gemma3_text", "gemma3"), READS, read_config, tiny_config,
                "google/gemma-3-27b-it", "full + SWA pools (SWA: window only)")
