"""The runner rejects page tables that do not cover the positions, and bad checkpoints (typed
errors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.errors import ClientError, ConfigError, PageError


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    model = load_model(write_model(tmp_path_factory.mktemp("m"), seed=0), "cpu", torch.float32)
    pools = KVPools(KVSpec.from_config(model.cfg), 20, 20, 16, "cpu", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=True, graph_batch_sizes=[1, 2])


def test_cpu_runner_never_builds_graphs(runner: ModelRunner) -> None:
    assert runner.graphs is None


def test_prefill_rejects_short_tables_and_bad_ids(runner: ModelRunner) -> None:
    with pytest.raises(PageError):
        runner.prefill(list(range(20)), [1], [1])
    with pytest.raises(PageError):
        runner.prefill(list(range(20)), [1, 99], [1, 2])
    with pytest.raises(PageError):
        runner.prefill(list(range(20)), [1, 2], [1, 2], start_pos=20)


def test_prefill_from_start_pos_needs_the_swa_window_held(runner: ModelRunner) -> None:
    tokens = list(range(200))
    full, swa = list(range(1, 14)), list(range(1, 14))
    runner.prefill(tokens[:150], full, swa)
    with pytest.raises(PageError, match="SWA"):
        runner.prefill(tokens, full, [0, 0, 0, 0, 0, *swa[5:]], start_pos=150)
    runner.prefill(tokens, full, [0, *swa[1:]], start_pos=150)  # [23, 150) is held


def test_missing_tensor_is_a_config_error(tmp_path: Path) -> None:
    d = write_model(tmp_path, seed=0, num_hidden_layers=2)
    (d / "config.json").write_text((d / "config.json").read_text().replace(
        '"num_hidden_layers": 2', '"num_hidden_layers": 3').replace(
        '"full_attention"\n  ]', '"full_attention", "sliding_attention"\n  ]'))
    with pytest.raises(ConfigError, match="lacks tensor"):
        load_model(d, "cpu", torch.float32)


def test_prefill_rejects_token_ids_outside_the_vocabulary(runner: ModelRunner) -> None:
    with pytest.raises(ClientError):
        runner.prefill([1, runner.model.cfg.vocab_size], [1], [1])
