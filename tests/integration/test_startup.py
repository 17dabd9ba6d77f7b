"""`decode-worker serve` refuses unsupported combinations at startup, naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DECODE_WORKER_")}
    return subprocess.run([sys.executable, "-m", "decode_worker", "serve", "--port", "1", *args],
                          capture_output=True, text=True, timeout=120, env={**base, **env})


@pytest.mark.parametrize(("env", "needle"), [
    ({"ENABLE_UNIFIED_RADIX_TREE": "0"}, "set ENABLE_UNIFIED_RADIX_TREE=1"),
    ({"DECODE_WORKER_CACHE__HIERARCHICAL_CACHE": "true",
      "DECODE_WORKER_CACHE__DECODE_RADIX_CACHE": "false"}, "hierarchical_cache = true needs"),
    ({"DECODE_WORKER_CACHE__HICACHE_SIZE_GB": "100000"}, "cache.hicache_size_gb"),
    ({"DECODE_WORKER_CACHE__NUM_SWA_PAGES": "2"}, "raise it to >="),
])
def test_serve_refuses_unsupported_combination(tmp_path: Path, env: dict[str, str],
                                               needle: str) -> None:
    out = _serve({"DECODE_WORKER_MODEL__CACHE_DIR": str(tmp_path), **env})
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_refuses_a_missing_model_dir(tmp_path: Path) -> None:
    out = _serve({}, "--model", str(tmp_path / "nope"))
    assert out.returncode == 2 and "no config.json" in out.stderr
