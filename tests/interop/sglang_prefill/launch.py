"""Start and stop prefill_server.py from another venv program (selfcheck, capture_frames)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
Server = subprocess.Popen  # of prefill_server.py


def start_prefill_server(bootstrap_port: int, control_port: int, extra: list[str],
                         timeout_s: float = 180.0) -> tuple[Server[bytes], dict[str, Any]]:
    """Launch prefill_server.py in its own session; return it and its `ready` line.

    Its stdout (the ready line and NIXL's own log lines) goes to a temporary file, so an
    unread pipe can never block it; stderr is inherited.
    """
    cmd = [sys.executable, str(HERE / "prefill_server.py"), "--bootstrap-port",
           str(bootstrap_port), "--control-port", str(control_port), *extra]
    fd, out_path = tempfile.mkstemp(prefix="prefill_server.", suffix=".out")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for line in Path(out_path).read_bytes().split(b"\n"):
            if line.startswith(b'{"event": "ready"'):
                return proc, json.loads(line)
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"prefill_server.py not ready in {timeout_s}s (exit {proc.poll()})")


def stop(proc: Server[bytes]) -> None:
    """Kill the server and its rank processes (one session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def post(port: int, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> Any:
    import requests

    resp = requests.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout_s)
    return resp.json()


def get(port: int, path: str, timeout_s: float = 10.0) -> Any:
    import requests

    return requests.get(f"http://127.0.0.1:{port}{path}", timeout=timeout_s).json()
