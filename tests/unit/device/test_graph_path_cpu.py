"""The graph decode path on CPU: buckets, dummy-row padding, static buffers and the capture guard.

`FakeGraphBackend` stands in for the CUDA capture (a replay re-runs the step into the same static
output), so everything around the capture runs here; tests/gpu checks the real CUDA graphs.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from decode_worker.device.cuda_graph import (
    CudaGraphDecoder,
    FakeGraphBackend,
    GraphCaptureError,
    check_capturable,
)
from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model import gpt_oss
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.errors import ConfigError
from tests.decode_steps import decode_lists, run_steps

BUCKETS = [1, 2, 4, 8]
PAGE = 16
CPU = torch.device("cpu")
TOL = 1e-5  # padding changes the batch shape, so matmul blocking may differ in the last bits


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GptOssModel:
    return load_model(write_model(tmp_path_factory.mktemp("m"), seed=0), "cpu", torch.float32)


def build(model: GptOssModel, backend: FakeGraphBackend | None, attention: str = "torch",
          buckets: list[int] = BUCKETS) -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), 160, 160, PAGE, "cpu", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=backend is not None,
                       graph_batch_sizes=buckets, max_graph_pages=32, graph_backend=backend,
                       attention_backend=attention)


def real_pages(runner: ModelRunner) -> list[torch.Tensor]:
    """Every layer's pages except the dummy page 0."""
    return [runner.pools.layer_tensor(i)[1:].clone() for i in range(len(runner.model.layers))]


@pytest.mark.parametrize("bs", [1, 2, 3, 5, 8])
def test_graph_path_equals_eager_and_padding_touches_only_page_0(model: GptOssModel,
                                                                  bs: int) -> None:
    lengths = [5 + 37 * i for i in range(bs)]  # spans the window (127) and page edges
    eager_runner = build(model, None)
    eager = run_steps(eager_runner, lengths, steps=5)
    backend = FakeGraphBackend()
    graphed_runner = build(model, backend)
    graphed = run_steps(graphed_runner, lengths, steps=5)
    assert graphed_runner.graphs is not None
    keys = set(graphed_runner.graphs.graphs)
    assert keys and all(size >= bs and size in BUCKETS for size, _ in keys)
    assert backend.captured == len(keys)
    assert (eager - graphed).abs().max().item() < TOL
    assert torch.equal(eager.argmax(-1), graphed.argmax(-1))
    # the dummy rows wrote to page 0 only: every real page holds what eager decode wrote
    for e, g in zip(real_pages(eager_runner), real_pages(graphed_runner), strict=True):
        assert (e - g).abs().max().item() < TOL


def test_a_request_that_left_the_batch_leaves_no_stale_row_behind(model: GptOssModel) -> None:
    """4 requests share bucket 4, then one finishes: its row must become a dummy row again,
    or the replay would keep writing into the finished request's pages."""

    def decode(runner: ModelRunner) -> list[torch.Tensor]:
        tables = [[1 + 2 * i, 2 + 2 * i] for i in range(4)]
        seqs = [[int(runner.prefill([7 + i] * 9, t, t).argmax())] for i, t in enumerate(tables)]
        for step in range(6):
            live = 4 if step < 2 else 3  # the last request leaves after two steps
            logits = decode_lists(runner, [s[-1] for s in seqs[:live]], [9 + step] * live,
                                  tables[:live], tables[:live])
            for s, row in zip(seqs, logits, strict=False):
                s.append(int(row.argmax()))
        return real_pages(runner)

    graphed = decode(build(model, FakeGraphBackend()))
    for e, g in zip(decode(build(model, None)), graphed, strict=True):
        assert (e - g).abs().max().item() < TOL


def test_batches_above_the_largest_bucket_or_wider_run_eager(model: GptOssModel) -> None:
    runner = build(model, FakeGraphBackend())
    assert runner.graphs is not None
    assert not runner.graphs.can_run(9, 4) and not runner.graphs.can_run(2, 33)
    mixed = run_steps(runner, [3] * 9, steps=2)
    assert not runner.graphs.graphs  # nothing was captured for them
    assert (run_steps(build(model, None), [3] * 9, steps=2) - mixed).abs().max().item() < TOL


def test_capture_graphs_prepares_every_bucket_and_destroy_releases(model: GptOssModel) -> None:
    backend = FakeGraphBackend()
    runner = build(model, backend)
    count = runner.capture_graphs(max_context_len=200)  # 13 pages: widths 1, 2, 4, 8, 13 -> 16
    assert count == len(BUCKETS) * 5 == backend.captured
    graphed = run_steps(runner, [40, 150], steps=3)
    assert backend.captured == count  # every step replayed a graph captured at start
    assert (run_steps(build(model, None), [40, 150], steps=3) - graphed).abs().max().item() < TOL
    runner.destroy()
    assert runner.graphs is None and backend.released


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernels run on CPU tensors only interpreted")
def test_triton_attention_has_one_graph_per_batch_bucket_and_matches_torch(
        model: GptOssModel) -> None:
    """The Triton kernels (under the interpreter here) in the graph step: tables at the graph
    width, dummy rows on page 0; one graph per batch bucket whatever the contexts."""
    backend = FakeGraphBackend()
    runner = build(model, backend, attention="triton", buckets=[1, 4])
    assert runner.attention_backend == "triton"
    assert runner.capture_graphs(max_context_len=400) == 2 == backend.captured  # 25 pages
    assert runner.graphs is not None and set(runner.graphs.graphs) == {(1, 32), (4, 32)}
    lengths = [5, 140, 77]  # bucket 4 with a dummy row; inside and past the window (127)
    graphed = run_steps(runner, lengths, steps=3)
    assert backend.captured == 2  # every step replayed a graph captured at start
    eager_runner = build(model, None)
    assert (run_steps(eager_runner, lengths, steps=3) - graphed).abs().max().item() < TOL
    for e, g in zip(real_pages(eager_runner), real_pages(runner), strict=True):
        assert (e - g).abs().max().item() < TOL


def test_the_decode_step_passes_the_capture_guard_on_every_moe_path(model: GptOssModel) -> None:
    runner = build(model, FakeGraphBackend())
    assert runner.graphs is not None
    step = runner.graphs.step
    for bs in (1, 4):  # 1 token x top-2 < 4 experts: weight gather; 4 tokens: dense experts
        tokens, tables = torch.zeros(bs, dtype=torch.long), torch.zeros(bs, 4, dtype=torch.long)
        check_capturable(partial(step, tokens, tokens, tables, tables), CPU)


def test_the_capture_guard_names_ops_a_cuda_graph_cannot_hold(model: GptOssModel) -> None:
    x = torch.randn(4, 8)
    cases = {
        "aten::_local_scalar_dense": lambda: x + x.sum().item(),
        "aten::nonzero": lambda: torch.nonzero(x > 0),
        "boolean mask": lambda: x[x > 0],
        "aten::lift_fresh": lambda: x + torch.tensor([1.0] * 8),
    }
    for name, fn in cases.items():
        with pytest.raises(GraphCaptureError, match=name) as err:
            check_capturable(fn, CPU)
        assert "scheduler.cuda_graph = false" in str(err.value)
        assert isinstance(err.value, ConfigError)  # startup refuses with the fix
    # the reference's expert loop (eager, many experts) is exactly what graphs must avoid
    lw, cfg = model.layers[0], model.cfg
    h = torch.randn(6, cfg.hidden_size)
    top_w, top_i = torch.softmax(torch.randn(6, 2), -1), torch.randint(0, 4, (6, 2))
    with pytest.raises(GraphCaptureError, match="unique"):
        check_capturable(lambda: gpt_oss._moe_loop(h, lw, cfg, top_i, top_w), CPU)


def test_a_step_that_fails_the_guard_is_never_captured() -> None:
    backend = FakeGraphBackend()

    def bad_step(tokens: torch.Tensor, positions: torch.Tensor, full_t: torch.Tensor,
                 swa_t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tokens.shape[0], 3) + int(tokens.sum())

    decoder = CudaGraphDecoder(bad_step, CPU, [1, 2], 4, backend, swa_ring=1)
    with pytest.raises(GraphCaptureError):
        decoder.run(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    assert backend.captured == 0 and not decoder.graphs
