"""The three MoE strategies (gather, dense, loop) compute the same thing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.device.default_model import write_model
from decode_worker.device.model import gpt_oss
from decode_worker.device.model.weights import load_model


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_moe_strategies_agree(tmp_path: Path, num_tokens: int) -> None:
    model = load_model(write_model(tmp_path, seed=2, num_local_experts=8,
                                   num_experts_per_tok=3), "cpu", torch.float32)
    lw, cfg = model.layers[0], model.cfg
    x = torch.randn(num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    top_v, top_i = torch.topk(torch.nn.functional.linear(x, lw.router_w, lw.router_b), 3)
    top_w = torch.softmax(top_v, dim=-1)
    outs = [f(x, lw, cfg, top_i, top_w) for f in (
        gpt_oss._moe_gather, gpt_oss._moe_dense, gpt_oss._moe_loop)]
    for out in outs[1:]:
        assert torch.allclose(out, outs[0], atol=1e-6, rtol=0)
    assert torch.allclose(gpt_oss.moe(x, lw, cfg, static=True), outs[0], atol=1e-6, rtol=0)
