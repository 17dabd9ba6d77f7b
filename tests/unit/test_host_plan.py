"""The host tier's operator surface at start-up: the budget line names its pages, size, how it
was sized and its write policy; an explicit size that does not fit the host's memory stops the
start-up, naming the key, before the model loads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from decode_worker.daemon.shared import host_plan, runtime
from decode_worker.daemon.shared.runtime import build_runtime
from decode_worker.device.default_model import write_model
from decode_worker.errors import ConfigError
from decode_worker.settings import load_settings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _settings(model_dir: Path, **overrides: object):  # type: ignore[no-untyped-def]
    return load_settings(overrides={
        "model.path": str(model_dir), "cache.page_size": 16, "cache.num_full_pages": 40,
        "cache.num_swa_pages": 32, "scheduler.cuda_graph": False, **overrides},
        environ={}).settings


def test_the_budget_line_shows_the_host_tier(model_dir: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    s = _settings(model_dir, **{"cache.hicache_ratio": 3.0,
                                "cache.hicache_write_policy": "write_back"})
    with caplog.at_level(logging.INFO, logger=runtime.__name__):
        rt = build_runtime(s, use_cuda_graph=False, host_tier=True)
    plan = rt.host_plan
    assert plan is not None and plan.num_pages == 120  # 3 x 40 device full pages
    line = next(r.getMessage() for r in caplog.records if "memory budget" in r.getMessage())
    assert "host tier 120 pages (1920 tokens)" in line
    assert "cache.hicache_ratio 3" in line and line.endswith("write_back")
    assert plan.info()["bytes"] == 120 * plan.page_bytes
    rt.runner.destroy()


def test_no_host_tier_no_host_part(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=runtime.__name__):
        rt = build_runtime(_settings(model_dir), use_cuda_graph=False)
    assert rt.host_plan is None
    assert not [r for r in caplog.records if "host tier" in r.getMessage()]
    rt.runner.destroy()


def test_a_size_past_the_hosts_memory_stops_start_up_naming_the_key(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_plan, "available_host_bytes", lambda: 2 * 10**9)
    loaded: list[object] = []
    monkeypatch.setattr(runtime, "load_model", lambda *a, **k: loaded.append(a))
    s = _settings(model_dir, **{"cache.hicache_size_gb": 3.0})
    with pytest.raises(ConfigError, match="cache.hicache_size_gb"):
        build_runtime(s, use_cuda_graph=False, host_tier=True)
    assert not loaded  # refused before the model loads


def test_a_derived_size_is_capped_and_says_so(model_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_plan, "available_host_bytes", lambda: 10**6)
    s = _settings(model_dir, **{"cache.hicache_ratio": 1000.0})
    plan = host_plan.plan_host_tier(s.cache, page_bytes=8192, num_device_pages=40, page_size=16)
    assert plan.num_pages == 10**6 // 2 // 8192 and "capped" in plan.describe()
