"""`model.moe_backend`: what the loader keeps, what the model runs, and the errors.

The Triton runs here go through Triton's interpreter on CPU (tests/conftest.py), on CUDA compiled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.daemon.shared.runtime import build_runtime
from decode_worker.device.cuda_graph import FakeGraphBackend
from decode_worker.device.default_model import tiny_config
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model import gpt_oss
from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.synthetic import random_mxfp4_checkpoint
from decode_worker.device.model.weights import from_state_dict, resolve_moe_backend
from decode_worker.device.runner import ModelRunner
from decode_worker.errors import ConfigError
from decode_worker.settings import load_settings
from tests.decode_steps import run_steps

CPU = torch.device("cpu")
CFG = GptOssConfig.from_dict(tiny_config())  # 4 layers, 4 experts, top-2, hidden 64


def test_backend_resolution_and_the_error_naming_the_setting() -> None:
    assert resolve_moe_backend("torch", CPU) == "torch"
    assert resolve_moe_backend("auto", CPU) == "torch"
    with pytest.raises(ConfigError, match=r"model\.moe_backend='triton'.*CUDA"):
        resolve_moe_backend("triton", CPU)
    if torch.cuda.is_available():
        assert resolve_moe_backend("auto", torch.device("cuda")) == "triton"


def test_triton_without_cuda_is_a_start_up_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    settings = load_settings(overrides={"model.moe_backend": "triton",
                                        "model.cache_dir": str(tmp_path)}, environ={}).settings
    with pytest.raises(ConfigError, match=r"model\.moe_backend"):
        build_runtime(settings, use_cuda_graph=False)
    with pytest.raises(ConfigError, match="moe_backend"):
        load_settings(overrides={"model.moe_backend": "cutlass"}, environ={})


def test_mxfp4_is_kept_in_place_for_triton_and_dequantized_for_torch() -> None:
    state = random_mxfp4_checkpoint(CFG, CPU, torch.float32, seed=0)
    kept = from_state_dict(CFG, state, CPU, torch.float32, moe_backend="triton").layers[1]
    blocks = state["model.layers.1.mlp.experts.gate_up_proj_blocks"]  # [E, 2I, H / 32, 16]
    assert kept.gate_up.dtype == torch.uint8 and kept.gate_up.shape == (4, 128, 32)
    assert kept.gate_up.data_ptr() == blocks.data_ptr()  # a view: no copy, no permutation
    assert kept.down.shape == (4, 64, 32) and kept.down_scales is not None
    dense = from_state_dict(CFG, state, CPU, torch.float32, moe_backend="torch").layers[1]
    assert dense.gate_up.shape == (4, 64, 128) and dense.gate_up_scales is None
    with pytest.raises(ConfigError, match="Triton MoE"):
        gpt_oss.moe(torch.zeros(2, 64), kept, CFG, static=False)  # the torch path refuses


def models() -> tuple[GptOssModel, GptOssModel]:
    """Two layers of the tiny shape (a sliding and a full one: the interpreter is slow) from
    one MXFP4 checkpoint: (MXFP4 kept, Triton MoE), (dequantized, torch MoE)."""
    cfg = GptOssConfig.from_dict(tiny_config(num_hidden_layers=2))
    state = random_mxfp4_checkpoint(cfg, CPU, torch.float32, seed=3)
    return (from_state_dict(cfg, state, CPU, torch.float32, moe_backend="triton"),
            from_state_dict(cfg, state, CPU, torch.float32, moe_backend="torch"))


def runner(model: GptOssModel, graphs: bool) -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), 64, 64, 16, "cpu", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=graphs, graph_batch_sizes=[1, 4],
                       max_graph_pages=16, graph_backend=FakeGraphBackend() if graphs else None)


def test_graph_decode_runs_the_triton_moe_not_the_dense_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill and graph-path decode steps on the Triton MoE equal the torch MoE's, and the
    all-experts `_moe_dense` never runs (float32: 1e-4 absolute on logits of ~0.1-1)."""
    triton_model, torch_model = models()
    reference = run_steps(runner(torch_model, graphs=True), [3, 20], steps=2)

    def refuse(*_: object) -> torch.Tensor:
        raise AssertionError("the dense MoE ran")

    monkeypatch.setattr(gpt_oss, "_moe_dense", refuse)
    graphed = runner(triton_model, graphs=True)
    got = run_steps(graphed, [3, 20], steps=2)  # [steps, bs, V]
    assert graphed.graphs is not None and graphed.graphs.graphs
    assert (got - reference).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
