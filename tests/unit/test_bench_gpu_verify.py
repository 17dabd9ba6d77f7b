"""`scripts/bench_gpu_verify.py` without a GPU: it says so and exits 0; its attention cell runs
the plain, grouped and per-entry paths (tiny shape, Triton's interpreter), so a lent GPU's
minutes are not lost to a bug in the script."""

from __future__ import annotations

import os

import pytest
import torch

from scripts import bench_gpu_verify as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the script measures")
def test_without_cuda_it_measures_nothing_and_exits_0(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", ["bench_gpu_verify.py"])
    assert bench.main() == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "bench_gpu_verify: needs CUDA (no CUDA device is visible); nothing measured")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU: the interpreter")
def test_an_attention_cell_runs_every_path() -> None:
    pools, tables = bench.attention_pools(1, 16, 15, 16, 2, 40, torch.device("cpu"))
    assert tables[0].shape == (2, 3) and tables[1].shape == (2, 3)  # cdiv(48, 16), ring 3
    for k, grouped in ((0, False), (3, True), (3, False)):
        ms = bench.attention_ms(pools, tables, 2, 15, 2, k, 40, grouped, iters=1)
        assert 0 < ms < 60_000
    req, pos = bench.entries(2, 3, 40)
    assert req.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and pos.tolist() == [39, 40, 41, 42] * 2
