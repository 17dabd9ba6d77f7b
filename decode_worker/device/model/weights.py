"""Load a gpt-oss Hugging Face directory (config.json + *.safetensors) into a `GptOssModel`.

Tensor names and shapes are the ones transformers uses (`model.layers.{i}.mlp.experts.gate_up_proj`
[E, H, 2I] with gate/up interleaved on the last axis, ...). Published checkpoints keep the expert
weights in MXFP4: `*_blocks` [E, rows, G, 16] uint8 (two 4-bit codes per byte, low nibble first)
and `*_scales` [E, rows, G] uint8 (a power-of-two exponent biased by 127, one per 32 values).

What the experts become depends on the MoE backend (`resolve_moe_backend`, `model.moe_backend`):
- `triton`: MXFP4 experts are kept as they are (blocks viewed as [E, rows, K / 2], no copy and no
  permutation: the kernel reads gate row 2j and up row 2j + 1 in place); dense experts stay dense
  and run through the same kernel;
- `torch`: MXFP4 experts are dequantized here, to dense [E, H, 2I] / [E, I, H] in the model dtype.
Dense gate/up columns and the gate/up bias are de-interleaved to [gate | up] in both cases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
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


def resolve_moe_backend(choice: str, device: torch.device) -> str:
    """`model.moe_backend` (auto | triton | torch) -> "triton" or "torch" for `device`.

    auto: triton on CUDA when triton imports, else torch. Raises ConfigError naming the setting
    for `triton` without a CUDA device or without triton (as `model.attention_backend`)."""
    # attention_backend imports this package (via kv_pool): imported here, not at the top
    from decode_worker.device.attention_backend import resolve_backend

    return resolve_backend("model.moe_backend", choice, device)


def load_model(model_dir: Path, device: torch.device | str,
               dtype: torch.dtype = torch.float32, *, moe_backend: str = "torch") -> GptOssModel:
    """config.json + safetensors -> a model on `device` in `dtype` (experts per `moe_backend`,
    "triton" or "torch": see the module docstring).

    Raises ConfigError for a missing file, a missing tensor or a shape mismatch.
    """
    model_dir = Path(model_dir)
    cfg = GptOssConfig.from_file(model_dir / "config.json")
    state = read_state_dict(model_dir)
    model = from_state_dict(cfg, state, torch.device(device), dtype, moe_backend=moe_backend)
    log.info("loaded gpt-oss from %s: %d layers, %d experts, dtype %s, device %s, MoE %s",
             model_dir, cfg.num_hidden_layers, cfg.num_local_experts, dtype, device, moe_backend)
    return model


def from_state_dict(cfg: GptOssConfig, state: Mapping[str, torch.Tensor],
                    device: torch.device, dtype: torch.dtype, *,
                    moe_backend: str = "torch") -> GptOssModel:
    """Build the model from HF-named tensors (dense or MXFP4 experts; MXFP4 is kept when
    `moe_backend` is "triton"). Tensors already on `device` in their target dtype are used
    as they are, not copied."""
    if moe_backend not in ("triton", "torch"):
        raise ConfigError(f"moe_backend={moe_backend!r}: expected triton or torch")

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"checkpoint lacks tensor {name!r}")
        return state[name].to(device=device, dtype=dtype)

    keep = moe_backend == "triton"
    layers = [_layer(cfg, i, get, state, device, dtype, keep)
              for i in range(cfg.num_hidden_layers)]
    embed = get("model.embed_tokens.weight")  # [V, H]
    _expect("model.embed_tokens.weight", embed, (cfg.vocab_size, cfg.hidden_size))
    lm_head = embed if cfg.tie_word_embeddings and "lm_head.weight" not in state \
        else get("lm_head.weight")  # [V, H]
    return GptOssModel(cfg, embed, layers, get("model.norm.weight"), lm_head,
                       moe_backend=moe_backend)


def _layer(cfg: GptOssConfig, i: int, get: Callable[[str], torch.Tensor],
           state: Mapping[str, torch.Tensor], device: torch.device,
           dtype: torch.dtype, keep_mxfp4: bool) -> LayerWeights:
    p = f"model.layers.{i}."
    a = p + "self_attn."
    qkv_w = torch.cat([get(f"{a}{n}_proj.weight") for n in "qkv"])  # [(nh + 2 nkv) hd, H]
    qkv_b = torch.cat([get(f"{a}{n}_proj.bias") for n in "qkv"])  # [(nh + 2 nkv) hd]
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    _expect(f"{a}qkv", qkv_w, (width, cfg.hidden_size))
    gate_up, down, gate_up_scales, down_scales = _experts(
        cfg, p + "mlp.experts.", state, device, dtype, keep_mxfp4)
    gate_up_b = get(p + "mlp.experts.gate_up_proj_bias")  # [E, 2I] interleaved
    return LayerWeights(
        input_norm=get(p + "input_layernorm.weight"),
        post_norm=get(p + "post_attention_layernorm.weight"),
        qkv_w=qkv_w, qkv_b=qkv_b,
        o_w=get(a + "o_proj.weight"), o_b=get(a + "o_proj.bias"),
        sinks=get(a + "sinks"),
        router_w=get(p + "mlp.router.weight"), router_b=get(p + "mlp.router.bias"),
        gate_up=gate_up, gate_up_b=_deinterleave(gate_up_b),
        down=down, down_b=get(p + "mlp.experts.down_proj_bias"),
        gate_up_scales=gate_up_scales, down_scales=down_scales)


Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _experts(cfg: GptOssConfig, prefix: str, state: Mapping[str, torch.Tensor],
             device: torch.device, dtype: torch.dtype, keep_mxfp4: bool) -> Experts:
    """(gate_up, down, gate_up_scales, down_scales) in the forms of `LayerWeights`: MXFP4
    blocks and scales when kept (both projections MXFP4 and `keep_mxfp4`), else dense."""
    e, h, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    projs = (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter))  # (name, rows, K)
    if keep_mxfp4 and all(prefix + n + "_blocks" in state for n, _, _ in projs):
        kept = []
        for name, rows, k in projs:
            blocks = state[prefix + name + "_blocks"].to(device)  # [E, rows, K / 32, 16] u8
            scales = state[prefix + name + "_scales"].to(device)  # [E, rows, K / 32] u8
            _expect(prefix + name + "_blocks", blocks, (e, rows, k // 32, 16))
            _expect(prefix + name + "_scales", scales, (e, rows, k // 32))
            if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
                raise ConfigError(f"{prefix + name}: MXFP4 blocks and scales must be uint8")
            kept += [blocks.reshape(e, rows, k // 2), scales]  # [E, rows, K / 2] (a view)
        return kept[0], kept[2], kept[1], kept[3]
    dense = []
    for name, rows, k in projs:
        full = prefix + name
        if full in state:
            dense.append(state[full].to(device=device, dtype=dtype))
        elif full + "_blocks" in state and full + "_scales" in state:
            dense.append(dequantize_mxfp4(state[full + "_blocks"].to(device),
                                          state[full + "_scales"].to(device), dtype))
        else:
            raise ConfigError(f"checkpoint lacks {full!r} (dense or MXFP4 blocks/scales)")
        _expect(full, dense[-1], (e, k, rows))
    return _deinterleave(dense[0]), dense[1], None, None


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Last axis [g0, u0, g1, u1, ...] -> [g0, g1, ..., u0, u1, ...]."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1).contiguous()


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ConfigError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
