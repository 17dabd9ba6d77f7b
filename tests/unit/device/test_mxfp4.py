"""MXFP4 expert weights: our dequantization equals the reference's, and loading either form of
a checkpoint gives the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_worker.device.default_model import write_model
from decode_worker.device.model.weights import dequantize_mxfp4, load_model


def random_mxfp4(experts: int, rows: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_the_reference_implementation() -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = random_mxfp4(3, 10, 2, seed=0)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    ref = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == ref.shape == (3, 64, 10)
    assert torch.equal(ours, ref)


def test_dequantize_known_values() -> None:
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F  # low nibble 0xF -> -6.0, high nibble 0x2 -> 1.0
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)  # 2 ** 1
    out = dequantize_mxfp4(blocks, scales)[0, :, 0]
    assert out[:2].tolist() == [-12.0, 2.0]
    assert not out[2:].any()


def test_loading_mxfp4_experts_equals_loading_dense(tmp_path: Path) -> None:
    dense_dir = write_model(tmp_path / "dense", seed=5, num_hidden_layers=2)
    state = load_file(str(dense_dir / "model.safetensors"))
    quant_dir = write_model(tmp_path / "quant", seed=5, num_hidden_layers=2)
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        for proj, (rows, cols) in (("gate_up_proj", (128, 64)), ("down_proj", (64, 64))):
            blocks, scales = random_mxfp4(4, rows, cols // 32, seed=i)
            del state[p + proj]  # replaced by its MXFP4 form
            state[p + proj + "_blocks"], state[p + proj + "_scales"] = blocks, scales
    save_file(state, str(quant_dir / "model.safetensors"))
    quant = load_model(quant_dir, "cpu", torch.float32)
    for i, layer in enumerate(quant.layers):
        blocks = state[f"model.layers.{i}.mlp.experts.down_proj_blocks"]
        scales = state[f"model.layers.{i}.mlp.experts.down_proj_scales"]
        assert torch.equal(layer.down, dequantize_mxfp4(blocks, scales))
        blocks = state[f"model.layers.{i}.mlp.experts.gate_up_proj_blocks"]
        scales = state[f"model.layers.{i}.mlp.experts.gate_up_proj_scales"]
        gate_up = dequantize_mxfp4(blocks, scales)  # [E, H, 2I] interleaved gate/up
        assert torch.equal(layer.gate_up, torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), -1))
