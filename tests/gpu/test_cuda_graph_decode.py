"""CUDA-graph decode replay equals eager decode, for every bucket and both attention backends
(the Triton kernel: one graph per batch bucket; torch: per batch and width bucket), against the
torch path run eager (needs CUDA; auto-skipped).

Run on a GPU machine: `python -m pytest -q tests/gpu -x` (about a minute: tiny model, float32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from tests.decode_steps import run_steps

pytestmark = pytest.mark.gpu

BUCKETS = [1, 2, 4, 8]
PAGE = 16
ATOL = 1e-4  # float32; the bound absorbs MoE path choice and split-K summation order
BACKENDS = ["torch", "triton"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GptOssModel:
    d = write_model(tmp_path_factory.mktemp("m"), seed=0)
    return load_model(d, "cuda", torch.float32)


def build(model: GptOssModel, graphs: bool, attention: str = "torch") -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), 512, 512, PAGE, "cuda", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=graphs, graph_batch_sizes=BUCKETS,
                       max_graph_pages=32, attention_backend=attention)


def test_auto_picks_the_triton_kernel_on_cuda(model: GptOssModel) -> None:
    assert build(model, graphs=False, attention="auto").attention_backend == "triton"


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("bs", [1, 2, 3, 4, 7, 8])
def test_graph_replay_equals_eager_for_every_bucket(model: GptOssModel, bs: int,
                                                    attention: str) -> None:
    lengths = [5 + 37 * i for i in range(bs)]  # spans the window (127) and page edges
    eager = run_steps(build(model, graphs=False), lengths, steps=6)
    graphed_runner = build(model, graphs=True, attention=attention)
    graphed = run_steps(graphed_runner, lengths, steps=6)
    assert graphed_runner.graphs is not None and graphed_runner.graphs.graphs
    assert (eager - graphed).abs().max().item() < ATOL
    graphed_runner.destroy()


@pytest.mark.parametrize("attention", BACKENDS)
def test_batches_above_the_largest_bucket_or_too_wide_run_eager(model: GptOssModel,
                                                                attention: str) -> None:
    runner = build(model, graphs=True, attention=attention)
    assert runner.graphs is not None
    assert not runner.graphs.can_run(9, 4)
    assert not runner.graphs.can_run(2, 33)
    eager = run_steps(build(model, graphs=False), [3] * 9, steps=2)
    mixed = run_steps(runner, [3] * 9, steps=2)
    assert (eager - mixed).abs().max().item() < ATOL


def test_cuda_matches_cpu_runtime(model: GptOssModel, tmp_path: Path) -> None:
    cpu_model = load_model(write_model(tmp_path, seed=0), "cpu", torch.float32)
    pools = KVPools(KVSpec.from_config(cpu_model.cfg), 512, 512, PAGE, "cpu", torch.float32)
    cpu = run_steps(ModelRunner(cpu_model, pools, use_cuda_graph=False, graph_batch_sizes=[1]),
                    [130, 20], steps=4)
    for attention in BACKENDS:
        gpu = run_steps(build(model, graphs=True, attention=attention), [130, 20], steps=4)
        assert (cpu - gpu.cpu()).abs().max().item() < 1e-3


def test_destroy_releases_graph_memory(model: GptOssModel) -> None:
    runner = build(model, graphs=True)
    run_steps(runner, [10, 10, 10, 10], steps=2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    runner.destroy()
    assert runner.graphs is None
    assert torch.cuda.memory_reserved() <= before


@pytest.mark.parametrize("attention", BACKENDS)
def test_capture_graphs_prepares_every_bucket(model: GptOssModel, attention: str) -> None:
    runner = build(model, graphs=True, attention=attention)
    count = runner.capture_graphs(max_context_len=300)  # 19 pages -> widths 1..16, 19 -> 32 cap
    assert count == len(BUCKETS) * (6 if attention == "torch" else 1)  # triton: width 32 only
    eager = run_steps(build(model, graphs=False), [40, 250], steps=3)
    graphed = run_steps(runner, [40, 250], steps=3)
    assert (eager - graphed).abs().max().item() < ATOL
    assert len(runner.graphs.graphs) == count  # type: ignore[union-attr]  # nothing new
    runner.destroy()
