"""README's main job: `decode-worker demo` runs both servers and reports what the cache saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_reports_reuse_bytes_saved_and_what_the_host_tier_held(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DECODE_WORKER_")}
    env["DECODE_WORKER_MODEL__CACHE_DIR"] = str(tmp_path)
    out = subprocess.run(
        # a device pool the three conversations outgrow (44 pages: the largest request needs
        # about 40), so part of the reuse comes back from the host tier
        [sys.executable, "-m", "decode_worker", "demo", "--turns", "3", "--conversations", "3",
         "--max-new-tokens", "8", "--device-pages", "44"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "== decode-worker demo ==" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["requests"] == 9 and summary["tokens_per_s"] > 0
    assert 0 < summary["kv_bytes_moved"] < summary["kv_bytes_without_cache"]
    assert "device pool 44 pages (704 tokens)" in out.stdout
    assert summary["host_hit_tokens"] > 0 and summary["host_restored_bytes"] > 0
    assert summary["device_hit_tokens"] > summary["host_hit_tokens"]
    host_line = next(line for line in out.stdout.splitlines() if "host tier" in line)
    assert f"{summary['host_hit_tokens']} reused tokens restored from it" in host_line
    rates = [line.split()[-1] for line in out.stdout.splitlines()
             if line.strip()[:1].isdigit() and line.strip().endswith("%")]
    # the second conversation reuses the shared system prompt; later turns their own history
    assert len(rates) == 3 and all(r != "0.0%" for r in rates), rates
