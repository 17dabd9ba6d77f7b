"""bfloat16 weights and pools run and stay close to float32 (the oracle itself is float32)."""

from __future__ import annotations

from pathlib import Path

import torch

from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from tests.decode_steps import decode_lists


def run(model_dir: Path, dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.Tensor:
    model = load_model(model_dir, "cpu", dtype)
    pools = KVPools(KVSpec.from_config(model.cfg), 32, 32, 16, "cpu", kv_dtype)
    runner = ModelRunner(model, pools, use_cuda_graph=False, graph_batch_sizes=[1])
    prompt = list(range(0, 250, 2))
    pages = list(range(1, 10))
    first = runner.prefill(prompt, pages, pages)  # [V] f32
    nxt = decode_lists(runner, [int(first.argmax())], [len(prompt)], [pages], [pages])
    assert first.dtype == nxt.dtype == torch.float32
    return torch.stack((first, nxt[0]))


def test_bf16_model_and_pools_track_fp32(tmp_path: Path) -> None:
    d = write_model(tmp_path, seed=0)
    ref = run(d, torch.float32, torch.float32)
    assert (run(d, torch.bfloat16, torch.bfloat16) - ref).abs().max().item() < 0.05
    assert (run(d, torch.float32, torch.bfloat16) - ref).abs().max().item() < 0.01
