"""`decode-worker serve` refuses unsupported combinations at startup, naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

CASES = [
    ({"ENABLE_UNIFIED_RADIX_TREE": "0"}, "set ENABLE_UNIFIED_RADIX_TREE=1"),
    ({"DECODE_WORKER_CACHE__HIERARCHICAL_CACHE": "true",
      "DECODE_WORKER_CACHE__DECODE_RADIX_CACHE": "false"}, "hierarchical_cache = true needs"),
    ({"DECODE_WORKER_CACHE__HICACHE_SIZE_GB": "100000"}, "cache.hicache_size_gb"),
    ({"DECODE_WORKER_CACHE__NUM_SWA_PAGES": "2"}, "raise it to >="),
]
Runs = dict[str, "Future[subprocess.CompletedProcess[str]]"]


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DECODE_WORKER_")}
    return subprocess.run([sys.executable, "-m", "decode_worker", "serve", "--port", "1", *args],
                          capture_output=True, text=True, timeout=120, env={**base, **env})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Every refused start of this module, run as the module starts, one per core at a time
    (each spends its seconds importing): the needle (or "missing model") -> the run. Each gets
    a model cache of its own."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        out = {needle: pool.submit(_serve, {"DECODE_WORKER_MODEL__CACHE_DIR": str(
            tmp_path_factory.mktemp("cache")), **env}) for env, needle in CASES}
        out["missing model"] = pool.submit(
            _serve, {}, "--model", str(tmp_path_factory.mktemp("empty") / "nope"))
        mistral = tmp_path_factory.mktemp("mistral")
        (mistral / "config.json").write_text(json.dumps(
            {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}))
        out["unsupported"] = pool.submit(_serve, {}, "--model", str(mistral))
        yield out


@pytest.mark.parametrize(("env", "needle"), CASES)
def test_serve_refuses_unsupported_combination(runs: Runs, env: dict[str, str],
                                               needle: str) -> None:
    out = runs[needle].result()
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_refuses_a_missing_model_dir(runs: Runs) -> None:
    out = runs["missing model"].result()
    assert out.returncode == 2 and "no config.json" in out.stderr


def test_serve_refuses_an_unsupported_architecture_in_one_line(runs: Runs) -> None:
    out = runs["unsupported"].result()
    assert out.returncode == 2 and "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "architectures=['MistralForCausalLM'] model_type='mistral' is not supported" in line
    assert "Qwen3ForCausalLM (qwen3)" in line and "Gemma3ForCausalLM" in line
