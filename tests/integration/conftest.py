"""Fixtures for the transfer tests: a real prefill peer process and a decode side in-process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_worker.daemon.decode.bridge import Event, Outbox
from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.device.default_model import write_model
from decode_worker.io.metrics import Metrics
from decode_worker.settings import load_settings

PEER_READY = "prefill peer ready"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny gpt-oss (seeded weights), written once per test module."""
    return write_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def recording_engine(model_dir: Path, loop: asyncio.AbstractEventLoop,
                     **overrides: object) -> tuple[DecodeEngine, list[Event]]:
    """A decode engine on the tiny model (page 16, eager, no growth reserve: admission
    overcommits) with `overrides` on top, and the list its outbox appends events to."""
    settings = load_settings(overrides={
        "model.path": str(model_dir), "cache.page_size": 16,
        "scheduler.decode_reserve_tokens": 0, "scheduler.cuda_graph": False, **overrides,
    }, environ={}).settings
    engine = DecodeEngine.build(settings, Metrics())
    events: list[Event] = []
    engine.outbox = Outbox(loop, events.extend)
    return engine, events


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A fresh event loop for an engine's outbox, closed after the test."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()



class PeerLaunch:
    """A `decode-worker prefill` process that was started; `ready()` waits for its ready line.
    `port` (bootstrap) and `http_port` 0: the peer binds free ones itself and reports them
    (`--ports-file`); both attributes hold the bound ports once `ready()` returned."""

    def __init__(self, port: int, cache_dir: Path, *extra: str, http_port: int = 0):
        sets = {
            "model.cache_dir": f'"{cache_dir}"',
            "cache.num_full_pages": "512",
            "cache.num_swa_pages": "512",
            "transfer.heartbeat_interval_s": "0.2",
            "transfer.peer_dead_after_s": "2.0",
            "server.port": str(http_port),
        }
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.port, self.http_port = port, http_port
        self._ports_file = Path(tempfile.mkdtemp(prefix="dw-peer-")) / "ports.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "decode_worker", "prefill", "--bootstrap-port", str(port),
             "--ports-file", str(self._ports_file), *args, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout or ():
                self.lines.append(line)
                if PEER_READY in line:
                    self._ready.set()
        except (ValueError, OSError):  # stdout closed by stop()
            pass

    def ready(self, timeout_s: float = 120.0) -> subprocess.Popen[str]:
        """Raises RuntimeError (with its output) if it exits or is not ready in time."""
        deadline = time.monotonic() + timeout_s
        while not (self._ready.wait(0.1) and self._ports_file.exists()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                stop(self.proc)
                raise RuntimeError("prefill peer did not start:\n" + "".join(self.lines[-40:]))
        ports = json.loads(self._ports_file.read_text())
        self.port, self.http_port = ports["bootstrap"], ports["http"]
        return self.proc


def start_prefill_peer(
    port: int, cache_dir: Path, *extra: str, http_port: int = 0
) -> subprocess.Popen[str]:
    """`decode-worker prefill` with its bootstrap (ZMQ) server on loopback:port and its HTTP
    server on `http_port` (0: a free one); returns once it is ready."""
    return PeerLaunch(port, cache_dir, *extra, http_port=http_port).ready()


def launch_prefill_peer(cache_dir: Path, *extra: str) -> PeerLaunch:
    """A ready `decode-worker prefill` on ports it bound itself (`port`, `http_port`)."""
    launch = PeerLaunch(0, cache_dir, *extra)
    launch.ready()
    return launch


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir holding the tiny default model, written once before any peer starts."""
    from decode_worker.device.default_model import ensure_default_model

    cache = tmp_path_factory.mktemp("models")
    ensure_default_model(cache, 0)
    return cache


@pytest.fixture(scope="module")
def prefill_peer(model_cache: Path) -> Iterator[int]:
    """A prefill peer shared by a module; yields its bootstrap port."""
    launch = launch_prefill_peer(model_cache)
    yield launch.port
    stop(launch.proc)
