"""config.json parsing and YaRN inverse frequencies against transformers' rotary embedding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from decode_worker.device.model.config import GptOssConfig, rope_inv_freq
from decode_worker.errors import ConfigError

BASE: dict[str, Any] = {
    "vocab_size": 100, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
    "num_experts_per_tok": 2, "max_position_embeddings": 131072}
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("extra", [
    {},
    {"rope_scaling": YARN, "rope_theta": 150000.0},
    {"rope_scaling": {**YARN, "truncate": False}, "rope_theta": 150000.0},
    {"rope_parameters": {**YARN, "rope_theta": 10000.0, "factor": 8.0}},
])
def test_rope_matches_transformers(extra: dict[str, Any]) -> None:
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig as HFConfig

    raw = {**BASE, **extra}
    reference = modeling.GptOssRotaryEmbedding(HFConfig(**raw))
    inv, scale = rope_inv_freq(GptOssConfig.from_dict({**raw, "model_type": "gpt_oss"}))
    assert torch.allclose(torch.tensor(inv), reference.inv_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(reference.attention_scaling)


def test_window_and_layer_split() -> None:
    cfg = GptOssConfig.from_dict({**BASE, "sliding_window": 128})
    assert cfg.window == 127
    assert (cfg.sliding_layers, cfg.full_layers) == ((0,), (1,))


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "llama"}, "model_type"),
    ({"num_key_value_heads": 3}, "multiple"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type"),
])
def test_bad_configs_are_config_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GptOssConfig.from_dict({**BASE, **change})
