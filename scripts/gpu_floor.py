"""The memory-bandwidth floor of a decode step and the weights' size, for gpt-oss's shapes.

Pure helpers of scripts/bench_gpu_decode.py (tests/unit/test_gpu_floor.py runs them on CPU). The
floor (docs/GPU.md, "Floor") is what no implementation beats: every weight a step
uses read once, every KV byte it attends to read once, at the measured copy bandwidth.
"""

from __future__ import annotations

import torch

from decode_worker.device.default_model import tiny_config
from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.synthetic import tensor_shapes
from decode_worker.device.model.weights import from_state_dict

GIB = 1 << 30
# gpt-oss-20b / -120b: same attention (64 q / 8 kv heads of 64, window 128), hidden 2880
_COMMON = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072,
           "dtype": "bfloat16"}
SHAPES = {"20b": {**_COMMON, "num_hidden_layers": 24, "num_local_experts": 32},
          "120b": {**_COMMON, "num_hidden_layers": 36, "num_local_experts": 128}}
MXFP4_BYTES_PER_VALUE = 4.25 / 8  # 4-bit codes + one 8-bit scale per 32 values


def shape_config(shape: str) -> GptOssConfig:
    """gpt-oss-20b's or -120b's architecture (tiny_config supplies the rest of config.json)."""
    return GptOssConfig.from_dict(tiny_config(**SHAPES[shape]))


def experts_hit(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer reads for `batch` tokens routed uniformly at random."""
    return num_experts * (1 - ((num_experts - top_k) / num_experts) ** batch)


def step_bytes(cfg: GptOssConfig, batch: int, context: int, *, mxfp4: bool) -> float:
    """Bytes one decode step must read at least: bf16 attention (qkv + o) and lm_head weights,
    the experts hit (MXFP4 or bf16), and bf16 K and V of `context` keys (full layers) or of the
    window (sliding layers) per request."""
    h, hd = cfg.hidden_size, cfg.head_dim
    qkv_o = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd * h \
        + h * cfg.num_attention_heads * hd
    attn = 2 * qkv_o * cfg.num_hidden_layers + 2 * cfg.vocab_size * h
    expert = 3 * h * cfg.intermediate_size  # gate_up H x 2I + down I x H
    per_value = MXFP4_BYTES_PER_VALUE if mxfp4 else 2
    experts = experts_hit(cfg.num_local_experts, cfg.num_experts_per_tok, batch) \
        * cfg.num_hidden_layers * expert * per_value
    keys = context * len(cfg.full_layers) + min(context, cfg.sliding_window) \
        * len(cfg.sliding_layers)
    kv = batch * keys * 2 * cfg.num_key_value_heads * hd * 2
    return attn + experts + kv


def floor_ms(num_bytes: float, bandwidth_gbps: float) -> float:
    return num_bytes / (bandwidth_gbps * 1e9) * 1e3


def shape_weights_gib(shape: str, moe_backend: str = "triton") -> float:
    """GiB of weights the loader keeps for `shape` in bf16 (meta tensors: nothing allocated)."""
    cfg = shape_config(shape)
    state = {name: torch.empty(size, dtype=dtype or torch.bfloat16, device="meta")
             for name, (size, dtype) in tensor_shapes(cfg).items()}
    model = from_state_dict(cfg, state, torch.device("meta"), torch.bfloat16,
                            moe_backend=moe_backend)
    return model.weights_bytes() / GIB


if __name__ == "__main__":  # helpers, not a program of their own
    import sys

    asked = bool({"-h", "--help"} & set(sys.argv[1:]))
    print("gpu_floor holds the floor helpers of scripts/bench_gpu_decode.py (run that one: "
          "python scripts/bench_gpu_decode.py --help)", file=sys.stdout if asked else sys.stderr)
    raise SystemExit(0 if asked else 2)
