"""gpt-oss model configuration: the fields of a Hugging Face `config.json` this runtime uses.

`window` here is the number of EARLIER tokens a sliding-window query sees: HF `sliding_window - 1`
(127 for gpt-oss, whose HF `sliding_window` is 128). Full-attention layers have no window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode_worker.device.model.arch import FULL, SLIDING, KVShape, LayerKinds
from decode_worker.device.model.rope import RopeSpec, yarn_inv_freq
from decode_worker.errors import ConfigError

__all__ = ["FULL", "GPT_OSS_ROPE", "SLIDING", "GptOssConfig", "rope_inv_freq"]

GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


@dataclass(frozen=True, slots=True)
class GptOssConfig(LayerKinds):
    """Architecture facts; build with `from_dict` / `from_file`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    sliding_window: int  # HF meaning: keys a query sees, itself included
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-5
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    max_position_embeddings: int = 131072
    rope: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False

    @property
    def window(self) -> int:
        """Earlier tokens a sliding query sees (HF sliding_window - 1)."""
        return self.sliding_window - 1

    @property
    def model_type(self) -> str:
        return "gpt_oss"

    @property
    def sglang_ordinary(self) -> bool:
        """False: SGLang lays gpt-oss out with SWA pools (a hybrid-SWA model there)."""
        return False

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attn_scale(self) -> float:
        return float(self.head_dim) ** -0.5

    def kv_shape(self, layer_type: str) -> KVShape:
        """K and V of every KV head, the same for both layer types."""
        return KVShape(self.num_key_value_heads, self.head_dim)

    @classmethod
    def from_file(cls, path: Path) -> GptOssConfig:
        """Read config.json; raises ConfigError on a missing file or unusable content."""
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot read model config: {exc}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> GptOssConfig:
        """Defaults follow transformers' GptOssConfig; raises ConfigError naming the field."""
        if raw.get("model_type", "gpt_oss") != "gpt_oss":
            raise ConfigError(f"{source}: model_type={raw.get('model_type')!r}, expected gpt_oss")
        try:
            cfg = _build(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: bad model config: {exc!r}") from None
        _check(cfg, source)
        return cfg


def _build(raw: dict[str, Any]) -> GptOssConfig:
    layers = int(raw.get("num_hidden_layers", 36))
    heads = int(raw.get("num_attention_heads", 64))
    hidden = int(raw.get("hidden_size", 2880))
    types = raw.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    given = raw.get("rope_parameters") or raw.get("rope_scaling")
    # No RoPE parameters at all: gpt-oss's own defaults. Given ones are completed the way
    # transformers completes them (notably `truncate` defaults to True there).
    rope = dict(given) if given else dict(GPT_OSS_ROPE)
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", raw.get("rope_theta", 150000.0))
    return GptOssConfig(
        vocab_size=int(raw.get("vocab_size", 201088)),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size", 2880)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        num_local_experts=int(raw.get("num_local_experts", 128)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 4)),
        sliding_window=int(raw.get("sliding_window") or 128),
        layer_types=tuple(types),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
        rope=rope,
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def _check(cfg: GptOssConfig, source: str) -> None:
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError(f"{source}: layer_types has {len(cfg.layer_types)} entries, "
                          f"num_hidden_layers={cfg.num_hidden_layers}")
    if any(t not in (SLIDING, FULL) for t in cfg.layer_types):
        raise ConfigError(f"{source}: layer_types may hold only {SLIDING!r} and {FULL!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{source}: num_attention_heads must be a multiple of "
                          "num_key_value_heads")
    if cfg.head_dim % 2 or cfg.sliding_window < 1:
        raise ConfigError(f"{source}: head_dim must be even and sliding_window >= 1")
    if cfg.rope["rope_type"] not in ("yarn", "default"):
        raise ConfigError(f"{source}: rope_type {cfg.rope['rope_type']!r} is not supported")
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_local_experts:
        raise ConfigError(f"{source}: num_experts_per_tok must be in [1, num_local_experts]")


def rope_inv_freq(cfg: GptOssConfig) -> tuple[list[float], float]:
    """Inverse frequencies (head_dim / 2 of them) and the cos/sin scale (YaRN's attention factor).

    Follows the YaRN formulas transformers uses for gpt-oss (`rope.yarn_inv_freq`: ramp between
    interpolated and extrapolated frequencies; attention factor 0.1 ln(factor) + 1).
    """
    base = float(cfg.rope["rope_theta"])
    dim = cfg.head_dim
    if cfg.rope["rope_type"] == "default":
        return [1.0 / base ** (i / dim) for i in range(0, dim, 2)], 1.0
    params = {k: v for k, v in cfg.rope.items() if k not in ("rope_type", "rope_theta")}
    return yarn_inv_freq(RopeSpec("yarn", base, params), dim, cfg.max_position_embeddings)
