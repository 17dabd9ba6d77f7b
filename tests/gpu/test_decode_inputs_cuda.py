"""Persistent decode inputs on CUDA (needs CUDA; auto-skipped): rows kept between steps, through
real CUDA graphs (pinned staging, non-blocking copies, device-side next tokens), equal rows
written afresh from page lists, and a step's tokens reach the host while later work is still
queued.

Run on a GPU machine: `python -m pytest -q tests/gpu -x`.
"""

from __future__ import annotations

import pytest
import torch

from decode_worker.device.decode_inputs import HostTokens
from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from tests.unit.device.test_decode_inputs import PAGE, decode_both_ways

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GptOssModel:
    return load_model(write_model(tmp_path_factory.mktemp("m"), seed=0), "cuda", torch.float32)


@pytest.mark.parametrize("graphs", [False, True])
def test_persistent_rows_equal_fresh_rows_on_cuda(model: GptOssModel, graphs: bool) -> None:
    def runner() -> ModelRunner:
        pools = KVPools(KVSpec.from_config(model.cfg), 256, 256, PAGE, "cuda", torch.float32)
        return ModelRunner(model, pools, use_cuda_graph=graphs, graph_batch_sizes=[1, 2, 4],
                           max_graph_pages=32)

    fresh, kept = decode_both_ways(runner, [5, 60, 140], 20)
    assert (fresh - kept).abs().max().item() < 1e-4


def test_host_tokens_arrive_while_later_work_is_queued() -> None:
    chosen = torch.arange(7, device="cuda") * 3  # [7]
    tokens = HostTokens(chosen)
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queued after the copy: the wait must not need it
        big = big @ big / 64
    assert tokens.wait() == [i * 3 for i in range(7)]
    torch.cuda.synchronize()


def test_host_tokens_bring_the_steps_logprobs_with_them() -> None:
    """The step's logprobs (extras) come to pinned host memory with its tokens, one event."""
    chosen = torch.arange(5, device="cuda")  # [5]
    lp = -torch.arange(5, device="cuda", dtype=torch.float32) / 10  # [5]
    top = torch.arange(10, device="cuda").view(5, 2)  # [5, 2]
    tokens = HostTokens(chosen, (lp, top))
    assert tokens.wait_array().tolist() == list(range(5))
    host_lp, host_top = tokens.extras()
    assert host_lp.device.type == "cpu" and host_lp.is_pinned()
    assert host_lp.tolist() == lp.cpu().tolist() and torch.equal(host_top, top.cpu())
