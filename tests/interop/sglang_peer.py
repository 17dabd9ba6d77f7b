"""The SGLang prefill harness (tests/interop/sglang_prefill/) as a child process of a main-env test.

The harness runs under the interpreter of scripts/setup_sglang.sh's venv and never imports
`decode_worker`; this module only starts it, talks to its control API over HTTP and kills it.
`venv_python()` is None where the venv is missing (tests skip then).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
PREFILL_SERVER = ROOT / "tests" / "interop" / "sglang_prefill" / "prefill_server.py"
TERMINAL = ("success", "failed", "error", "timeout")


def venv_python() -> Path | None:
    """The SGLang venv's interpreter (`SGLANG_VENV`, default .venv-sglang), if it exists."""
    venv = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
    python = (venv if venv.is_absolute() else ROOT / venv) / "bin" / "python"
    return python if python.exists() else None


@dataclass(frozen=True)
class HarnessPorts:
    """Every port one harness may bind: bootstrap and control HTTP, its ranks' ZMQ PULL sockets
    and UCX's TCP listeners (ranges `lo-hi`)."""

    bootstrap: int
    control: int
    zmq_range: str
    ucx_range: str


class SglangPrefill:
    """prefill_server.py (SGLang's own prefill classes) in its own session; `start`, then
    `wait_ready`. `kill` ends every rank process at once (SIGKILL to the session)."""

    def __init__(self, python: Path, ports: HarnessPorts, args: list[str]) -> None:
        self.ports = ports
        self.cmd = [str(python), str(PREFILL_SERVER), "--bootstrap-port", str(ports.bootstrap),
                    "--control-port", str(ports.control), *args]
        self.env = {**os.environ, "SGLANG_CPU_ZMQ_PORTS": ports.zmq_range,
                    "UCX_TCP_PORT_RANGE": ports.ucx_range, "HF_HUB_OFFLINE": "1"}
        self.log = Path(tempfile.mkstemp(prefix="sglang-prefill.", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{ports.control}",
                                 timeout=httpx.Timeout(30.0, connect=5.0))

    def start(self) -> SglangPrefill:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True, cwd=ROOT)
        return self

    def wait_ready(self, timeout_s: float = 150.0) -> dict[str, Any]:
        """The server's `ready` line (every rank registered with the bootstrap server)."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in self.log.read_bytes().split(b"\n"):
                if line.startswith(b'{"event": "ready"'):
                    return dict(json.loads(line))
            time.sleep(0.2)
        raise RuntimeError(f"SGLang prefill harness not ready (exit {self.proc.poll()}):\n"
                           f"{self.output()[-4000:]}")

    def wait_healthy(self, timeout_s: float = 150.0) -> float:
        """Poll GET /health on the control port every 10 ms (it answers once every rank has
        registered with the bootstrap server); returns `time.monotonic()` of the first 200."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get("/health", timeout=1.0).status_code == 200:
                    return time.monotonic()
            time.sleep(0.01)
        raise RuntimeError(f"SGLang prefill harness not healthy (exit {self.proc.poll()}):\n"
                           f"{self.output()[-4000:]}")

    def prefill(self, spec: dict[str, Any]) -> dict[str, Any]:
        """POST /prefill: start a room on every rank (202 at once)."""
        resp = self.http.post("/prefill", json=spec)
        assert resp.status_code in (200, 202), resp.text
        return dict(resp.json())

    def room(self, room: int) -> dict[str, Any] | None:
        resp = self.http.get(f"/rooms/{room}")
        return None if resp.status_code == 404 else dict(resp.json())

    def wait_room(self, room: int, statuses: tuple[str, ...] = TERMINAL,
                  timeout_s: float = 15.0) -> dict[str, Any]:
        """Poll GET /rooms/<room> until its status (the least advanced rank's) is one of
        `statuses`; the last state seen after `timeout_s` otherwise."""
        deadline = time.monotonic() + timeout_s
        state: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            state = self.room(room)
            if state is not None and state["status"] in statuses:
                return state
            time.sleep(0.02)
        return state or {"room": room, "status": "unknown"}

    def kill(self) -> None:
        """SIGKILL the whole session (the server and its rank processes); waits for it."""
        self.http.close()
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):  # rank children may outlive the server
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")
