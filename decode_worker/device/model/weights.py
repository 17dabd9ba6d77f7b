"""Load a gpt-oss Hugging Face directory (config.json + *.safetensors) into a `GptOssModel`.

Tensor names and shapes are the ones transformers uses (`model.layers.{i}.mlp.experts.gate_up_proj`
[E, H, 2I] with gate/up interleaved on the last axis, ...). Published checkpoints keep the expert
weights in MXFP4: `*_blocks` [E, rows, G, 16] uint8 (two 4-bit codes per byte, low nibble first)
and `*_scales` [E, rows, G] uint8 (a power-of-two exponent biased by 127, one per 32 values).
Those are dequantized here, since no MXFP4 kernel is used by this runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.gpt_oss import GptOssModel, LayerWeights
from decode_worker.errors import ConfigError

log = logging.getLogger(__name__)

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> dense, in the orientation the reference's experts use.

    blocks: [E, rows, G, B] uint8, scales: [E, rows, G] uint8 -> [E, G * B * 2, rows].
    Value j of group g is `FP4[code] * 2 ** (scale - 127)`; code 2k is the low nibble of byte k.
    """
    if blocks.shape[:-1] != scales.shape:
        raise ConfigError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                          f"{tuple(scales.shape)} disagree")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)  # [16]
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * width * 2, rows, dtype=dtype, device=blocks.device)
    for e in range(experts):  # one expert at a time bounds the float32 temporaries
        b = blocks[e].to(torch.uint8)  # [rows, G, B]
        lo, hi = lut[(b & 0x0F).long()], lut[(b >> 4).long()]  # [rows, G, B] each
        vals = torch.stack((lo, hi), dim=-1).flatten(-2)  # [rows, G, 2B]
        exp = scales[e].to(torch.int32) - 127  # [rows, G]
        vals = torch.ldexp(vals, exp[..., None].float())  # [rows, G, 2B]
        out[e] = vals.flatten(-2).T.to(dtype)  # [G * 2B, rows]
    return out


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `model_dir` (CPU tensors)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                state[name] = sf.get_tensor(name)
    return state


def load_model(model_dir: Path, device: torch.device | str,
               dtype: torch.dtype = torch.float32) -> GptOssModel:
    """config.json + safetensors -> a model on `device` in `dtype`.

    Raises ConfigError for a missing file, a missing tensor or a shape mismatch.
    """
    model_dir = Path(model_dir)
    cfg = GptOssConfig.from_file(model_dir / "config.json")
    state = read_state_dict(model_dir)
    model = from_state_dict(cfg, state, torch.device(device), dtype)
    log.info("loaded gpt-oss from %s: %d layers, %d experts, dtype %s, device %s",
             model_dir, cfg.num_hidden_layers, cfg.num_local_experts, dtype, device)
    return model


def from_state_dict(cfg: GptOssConfig, state: dict[str, torch.Tensor],
                    device: torch.device, dtype: torch.dtype) -> GptOssModel:
    """Build the model from HF-named tensors (dense or MXFP4 experts)."""

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"checkpoint lacks tensor {name!r}")
        return state[name].to(device=device, dtype=dtype)

    layers = [_layer(cfg, i, get, state, device, dtype) for i in range(cfg.num_hidden_layers)]
    embed = get("model.embed_tokens.weight")  # [V, H]
    _expect("model.embed_tokens.weight", embed, (cfg.vocab_size, cfg.hidden_size))
    lm_head = embed if cfg.tie_word_embeddings and "lm_head.weight" not in state \
        else get("lm_head.weight")  # [V, H]
    return GptOssModel(cfg, embed, layers, get("model.norm.weight"), lm_head)


def _layer(cfg: GptOssConfig, i: int, get: Callable[[str], torch.Tensor],
           state: dict[str, torch.Tensor], device: torch.device,
           dtype: torch.dtype) -> LayerWeights:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    qkv_w = torch.cat([get(f"{a}{n}_proj.weight") for n in "qkv"])  # [(nh + 2 nkv) hd, H]
    qkv_b = torch.cat([get(f"{a}{n}_proj.bias") for n in "qkv"])  # [(nh + 2 nkv) hd]
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    _expect(f"{a}qkv", qkv_w, (width, cfg.hidden_size))
    gate_up, down = _experts(p + "mlp.experts.", state, device, dtype)
    e, inter = cfg.num_local_experts, cfg.intermediate_size
    _expect(p + "mlp.experts.gate_up_proj", gate_up, (e, cfg.hidden_size, 2 * inter))
    _expect(p + "mlp.experts.down_proj", down, (e, inter, cfg.hidden_size))
    gate_up_b = get(p + "mlp.experts.gate_up_proj_bias")  # [E, 2I] interleaved
    return LayerWeights(
        input_norm=get(p + "input_layernorm.weight"),
        post_norm=get(p + "post_attention_layernorm.weight"),
        qkv_w=qkv_w, qkv_b=qkv_b,
        o_w=get(a + "o_proj.weight"), o_b=get(a + "o_proj.bias"),
        sinks=get(a + "sinks"),
        router_w=get(p + "mlp.router.weight"), router_b=get(p + "mlp.router.bias"),
        gate_up=_deinterleave(gate_up), gate_up_b=_deinterleave(gate_up_b),
        down=down, down_b=get(p + "mlp.experts.down_proj_bias"))


def _experts(prefix: str, state: dict[str, torch.Tensor], device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for proj in ("gate_up_proj", "down_proj"):
        name = prefix + proj
        if name in state:
            out.append(state[name].to(device=device, dtype=dtype))
        elif name + "_blocks" in state and name + "_scales" in state:
            blocks = state[name + "_blocks"].to(device)
            scales = state[name + "_scales"].to(device)
            out.append(dequantize_mxfp4(blocks, scales, dtype))
        else:
            raise ConfigError(f"checkpoint lacks {name!r} (dense or MXFP4 blocks/scales)")
    return out[0], out[1]


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Last axis [g0, u0, g1, u1, ...] -> [g0, g1, ..., u0, u1, ...]."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1).contiguous()


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ConfigError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
