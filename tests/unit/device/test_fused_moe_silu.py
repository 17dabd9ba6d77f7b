"""The fused Triton MoE in Qwen3-MoE's form (plain SiLU-gated experts, no biases, softmax top-k
routing renormalised or not) against the torch path (`layers.softmax_topk` +
`routed_experts`), under Triton's interpreter on CPU; then a whole tiny Qwen3-MoE with its
experts on the Triton MoE against the same model on torch ops. Float32: the two differ only in
summation order (1e-5 of the largest magnitude, as tests/unit/device/test_fused_moe.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from decode_worker.device.kernels.fused_moe import fused_moe
from decode_worker.device.model import layers
from decode_worker.device.model.decoder import ExpertView
from decode_worker.device.model.registry import load_model
from decode_worker.device.model.tiny import write_tiny_model


@pytest.mark.parametrize(("num_tokens", "renormalize"), [(1, True), (5, False), (33, True)])
def test_silu_experts_match_the_torch_path(num_tokens: int, renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inter, top_k = 8, 64, 32, 2
    x = torch.randn(num_tokens, hidden, generator=gen)  # [T, H]
    router = torch.randn(num_tokens, experts, generator=gen)  # [T, E]
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2  # checkpoint form
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.2  # [E, H, I]
    view = ExpertView(gate_up.transpose(1, 2), torch.zeros(experts, 2 * inter),
                      down.transpose(1, 2), torch.zeros(experts, hidden))
    out = fused_moe(x, router, view, top_k, 1.0, 0.0, silu=True, renormalize=renormalize)
    top_i, top_w = layers.softmax_topk(router, top_k, renormalize)
    ref = layers.routed_experts(x, top_i, top_w, view.gate_up, view.down, layers.gated("silu"))
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err


def test_a_qwen3_moe_model_on_the_triton_moe_equals_torch(tmp_path: Path) -> None:
    from tests.oracle.test_oracle_families import runner_of

    path = write_tiny_model(tmp_path / "moe", "qwen3_moe")
    logits = []
    for backend in ("torch", "triton"):
        model = load_model(path, "cpu", torch.float32, moe_backend=backend)
        logits.append(runner_of(model, 16, 8).prefill(list(range(3, 40)), [1, 2, 3], [0] * 3))
    assert (logits[0] - logits[1]).abs().max() < 1e-5
