"""Random gpt-oss checkpoints of any shape, built in memory with MXFP4 experts.

For benchmarks at a real model's shape (scripts/bench_gpu_decode.py) and kernel tests: tensor
names, dtypes and layouts are a published checkpoint's (`weights.py`), so the product's own
loader reads them. Tensors are drawn directly on `device` in their checkpoint dtype (no float32
copy of a 13 GB model on the host). Dense weights are N(0, 0.02); norms 1 + N(0, 0.02); biases and
sinks random too; MXFP4 codes uniform over all 16, scale bytes uniform in `scale_range`
(127 - 8 .. 127 - 3 by default: weights around 0.01-0.2, like a trained model's).
"""

from __future__ import annotations

import torch

from decode_worker.device.model.config import GptOssConfig

INIT_STD = 0.02


def tensor_shapes(cfg: GptOssConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor of the checkpoint: name -> (shape, dtype; None = the model dtype)."""
    h, inter, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    u8 = torch.uint8
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), None),
        "model.norm.weight": ((h,), None), "lm_head.weight": ((cfg.vocab_size, h), None)}
    for i in range(cfg.num_hidden_layers):
        p, a, x = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        shapes.update({
            p + "input_layernorm.weight": ((h,), None),
            p + "post_attention_layernorm.weight": ((h,), None),
            a + "q_proj.weight": ((nh * hd, h), None), a + "q_proj.bias": ((nh * hd,), None),
            a + "k_proj.weight": ((nkv * hd, h), None), a + "k_proj.bias": ((nkv * hd,), None),
            a + "v_proj.weight": ((nkv * hd, h), None), a + "v_proj.bias": ((nkv * hd,), None),
            a + "o_proj.weight": ((h, nh * hd), None), a + "o_proj.bias": ((h,), None),
            a + "sinks": ((nh,), None),
            x + "router.weight": ((e, h), None), x + "router.bias": ((e,), None),
            x + "experts.gate_up_proj_blocks": ((e, 2 * inter, h // 32, 16), u8),
            x + "experts.gate_up_proj_scales": ((e, 2 * inter, h // 32), u8),
            x + "experts.gate_up_proj_bias": ((e, 2 * inter), None),
            x + "experts.down_proj_blocks": ((e, h, inter // 32, 16), u8),
            x + "experts.down_proj_scales": ((e, h, inter // 32), u8),
            x + "experts.down_proj_bias": ((e, h), None),
        })
    return shapes


def random_mxfp4_checkpoint(cfg: GptOssConfig, device: torch.device | str,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            scale_range: tuple[int, int] = (119, 124)) -> dict[str, torch.Tensor]:
    """A state dict in the checkpoint's form (MXFP4 experts), every tensor on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, (shape, kind) in tensor_shapes(cfg).items():
        if kind == torch.uint8:
            low, high = scale_range if name.endswith("_scales") else (0, 256)
            state[name] = torch.randint(low, high, shape, generator=gen, dtype=torch.uint8,
                                        device=device)
            continue
        t = torch.randn(shape, generator=gen, dtype=kind or dtype, device=device)
        t.mul_(INIT_STD)
        if name.endswith("norm.weight"):
            t.add_(1.0)
        state[name] = t
    return state
