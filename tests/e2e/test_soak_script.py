"""CI's chaos run: `scripts/soak.py --duration 60 --seed 1` against real processes exits 0 and
ends with the contract line, every request answered and no page leaked; a quarter of the turns
(the default `--grpc-share`) went over smg's gRPC worker protocol, every one answered, and the
worker's own count of the gRPC calls it answered agrees with the client's; the host tier carried
prefixes the small device pool could not hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GRPC_DOOR = re.compile(r"door grpc: sent=(\d+) tokens=(\d+) error=(\d+) unanswered=(\d+)")
LAST = re.compile(r"soak: seconds=(\d+) faults=(\d+) requests=(\d+) unanswered=(\d+) "
                  r"leaked_pages=(\d+)")


def test_soak_60s_answers_everything_and_leaks_nothing(e2e_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", "60", "--seed", "1",
         "--model", str(e2e_model_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    m = LAST.fullmatch(lines[-1])
    assert m, f"last line {lines[-1]!r}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    seconds, faults, requests, unanswered, leaked = map(int, m.groups())
    assert out.returncode == 0, out.stdout[-4000:]
    assert unanswered == 0 and leaked == 0, out.stdout[-4000:]
    assert seconds >= 60 and faults >= 5 and requests > faults, out.stdout[-4000:]
    host = next(line for line in lines if line.startswith("host tier: "))
    assert host.endswith(" ok"), host  # host hits restored under the small device pool
    door = GRPC_DOOR.search(out.stdout)
    assert door, out.stdout[-4000:]
    sent, tokens, _, lost = map(int, door.groups())
    assert sent >= 10 and tokens >= 5 and lost == 0, out.stdout[-4000:]
    assert re.search(r"^grpc: worker_ok=\d+ client_tokens=\d+ grpc_ok_checked=\w+ agree$",
                     out.stdout, re.M), out.stdout[-4000:]
