"""Rotary position embeddings: the variants the supported families use, each as transformers
computes it (`modeling_rope_utils.py`), and reading them from both config forms.

- default: inv_freq_i = theta ** (-2i / d);
- linear: default / factor (Gemma 3's global layers);
- llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between
  (Llama 3.1+: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings);
- yarn: a ramp between interpolated and extrapolated frequencies, cos/sin scaled by the
  attention factor 0.1 ln(factor) + 1 (gpt-oss, Qwen3 long context).

Config forms: the hub's `rope_theta` + `rope_scaling` (+ Gemma's `rope_local_base_freq` for
sliding layers) and transformers 5's `rope_parameters` (flat, or keyed by layer type).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from decode_worker.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One RoPE: its type, base and the type's parameters (as the config names them)."""

    rope_type: str
    theta: float
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, raw: dict[str, Any], theta: float | None, source: str) -> RopeSpec:
        """From a rope_scaling / rope_parameters dict (`theta` when it names none). Raises
        ConfigError naming the field for an unknown type or a missing parameter."""
        kind = str(raw.get("rope_type") or raw.get("type") or "default")
        if kind not in ROPE_TYPES:
            raise ConfigError(f"{source}: rope_type {kind!r} is not supported "
                              f"(supported: {', '.join(ROPE_TYPES)})")
        base = raw.get("rope_theta", theta)
        if not isinstance(base, int | float) or base <= 0:
            raise ConfigError(f"{source}: rope_theta must be a positive number, got {base!r}")
        need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings"),
                "yarn": ("original_max_position_embeddings",)}.get(kind, ())
        for key in need:
            if not isinstance(raw.get(key), int | float):
                raise ConfigError(f"{source}: rope {kind} needs a number for {key!r}")
        params = {k: v for k, v in raw.items() if k not in ("rope_type", "type", "rope_theta")}
        return cls(kind, float(base), params)


def read_rope(raw: dict[str, Any], layer_types: tuple[str, ...], default_theta: float,
              source: str, local_key: str | None = None,
              local_theta: float | None = None) -> dict[str, RopeSpec]:
    """Layer type -> RopeSpec from either config form. With `local_key` (Gemma's
    `rope_local_base_freq`) sliding layers get a plain RoPE of that base and `rope_scaling`
    applies to full layers only, as transformers reads Gemma 3."""
    given = raw.get("rope_parameters")
    types = sorted(set(layer_types))
    if isinstance(given, dict) and given and all(isinstance(v, dict) for v in given.values()) \
            and set(given) <= {"full_attention", "sliding_attention"}:
        return {t: RopeSpec.of(given.get(t) or {}, _theta(raw, t, default_theta, local_key,
                                                          local_theta), source) for t in types}
    flat = given if isinstance(given, dict) else (raw.get("rope_scaling") or {})
    if not isinstance(flat, dict):
        raise ConfigError(f"{source}: rope_scaling must be an object, got {flat!r}")
    out = {}
    for t in types:
        theta = _theta(raw, t, default_theta, local_key, local_theta)
        local = local_key is not None and t == "sliding_attention"
        out[t] = RopeSpec.of({} if local else flat, theta, source)
    return out


def _theta(raw: dict[str, Any], layer_type: str, default: float, local_key: str | None,
           local_default: float | None) -> float:
    if local_key is not None and layer_type == "sliding_attention":
        return float(raw.get(local_key) or local_default or default)
    return float(raw.get("rope_theta") or default)


def inv_freq(spec: RopeSpec, head_dim: int, max_position_embeddings: int
             ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] f32 and the cos/sin scale, as transformers' init
    functions compute them (in float32 torch ops, so the products match bit for bit)."""
    dim, p = head_dim, spec.params
    if spec.rope_type == "yarn":
        inv, scale = yarn_inv_freq(spec, dim, max_position_embeddings)
        return torch.tensor(inv, dtype=torch.float32), scale
    base = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_type == "default":
        return base, 1.0
    factor = float(p["factor"])
    if spec.rope_type == "linear":
        return base / factor, 1.0
    low_f, high_f = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > old / low_f, base / factor, base)
    smooth = (old / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high_f) * ~(wavelen > old / low_f)
    return torch.where(medium, smoothed, scaled), 1.0


def yarn_inv_freq(spec: RopeSpec, dim: int, max_position_embeddings: int
                  ) -> tuple[list[float], float]:
    """YaRN (as transformers computes it for gpt-oss): a ramp between interpolated and
    extrapolated frequencies; attention factor 0.1 ln(factor) + 1 unless given."""
    p, base = spec.params, spec.theta
    pos_freqs = [base ** (i / dim) for i in range(0, dim, 2)]
    orig = float(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or max_position_embeddings / orig)
    scale = float(p.get("attention_factor") or (
        1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0))

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = corr_dim(float(p.get("beta_fast") or 32.0))
    high = corr_dim(float(p.get("beta_slow") or 1.0))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    inv = []
    for i, f in enumerate(pos_freqs):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extra = 1.0 - ramp  # weight of the extrapolated (unscaled) frequency
        inv.append((1.0 / (factor * f)) * (1.0 - extra) + (1.0 / f) * extra)
    return inv, scale
