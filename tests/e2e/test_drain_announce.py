"""Start-up and stop of a real `decode-worker serve`, as an operator meets them: SIGTERM first
announces (/health 503 while requests are still served, an idle worker included) and then
refuses; a taken HTTP port is one line naming `server.port` before the model loads; port 0 with
`--ports-file` reports the bound port; `--print-config` shows what `serve`'s own flags resolve
to."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e.live_fixtures import Live, gen_body, live_server

ANNOUNCE_S = 2.0
SETS = ("--set", f"server.drain_announce_s={ANNOUNCE_S}", "--set", "server.drain_grace_s=3")


def _cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DECODE_WORKER_")}
    return subprocess.run([sys.executable, "-m", "decode_worker", *args], capture_output=True,
                          text=True, timeout=timeout_s, env=env, check=False)


def _sigterm_and_see_the_announce(w: Live) -> float:
    """SIGTERM; /health turns 503 `draining` at once while a request is still served. Returns
    when the signal was sent."""
    assert w.proc.proc is not None
    signalled = time.monotonic()
    w.proc.proc.send_signal(signal.SIGTERM)
    health = w.get("/health")
    while health.status_code == 200 and time.monotonic() - signalled < ANNOUNCE_S / 2:
        health = w.get("/health")
    assert health.status_code == 503 and health.json()["error"]["reason"] == "draining"
    served = w.post("/generate", gen_body([4, 5, 6], 2))  # within the window: served
    assert time.monotonic() - signalled < ANNOUNCE_S, "the check came too late"
    assert served.status_code == 200, served.text
    return signalled


def _wait_running(w: Live, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while w.metrics().value("decode_worker_queue_requests", queue="running") < 1:
        assert time.monotonic() < deadline, "the long request never ran"
        time.sleep(0.05)


def test_an_idle_worker_announces_for_the_whole_window_before_it_exits(
        e2e_model_dir: Path) -> None:
    with live_server(e2e_model_dir, *SETS) as w:
        signalled = _sigterm_and_see_the_announce(w)
        assert w.proc.proc is not None and w.proc.proc.wait(20) == 0
        took = time.monotonic() - signalled
    assert ANNOUNCE_S <= took < ANNOUNCE_S + 10, took
    assert "while still serving (server.drain_announce_s)" in w.proc.output()


def test_after_the_window_new_requests_are_refused_and_running_ones_drain(
        e2e_model_dir: Path) -> None:
    with live_server(e2e_model_dir, *SETS) as w, ThreadPoolExecutor(1) as pool:
        long = pool.submit(w.post, "/generate", gen_body([7, 8, 9], 4000))  # past the grace
        _wait_running(w)
        signalled = _sigterm_and_see_the_announce(w)
        while time.monotonic() - signalled < ANNOUNCE_S - 0.2:
            assert w.post("/generate", gen_body([4, 5], 1)).status_code == 200
            time.sleep(0.1)
        time.sleep(0.5)  # past the window
        refused = w.post("/generate", gen_body([4, 5], 1))
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["message"] == "draining: not accepting new requests"
        ended = long.result(timeout=30)
        assert w.proc.proc is not None and w.proc.proc.wait(20) == 0
    assert ended.status_code == 503 and ended.json()["error"]["reason"] == "drain", ended.text


def test_a_taken_port_is_one_line_naming_server_port_before_the_model_loads(
        tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = tmp_path / "no-model-here"  # loading it would fail with another message
        done = _cli("serve", "--model", str(missing), "--port", str(port))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"server.port = {port}: cannot bind 127.0.0.1:{port}" in lines[0]
    assert "Address already in use" in lines[0]


def test_port_zero_and_a_ports_file_report_every_bound_port(tmp_path: Path) -> None:
    """HTTP, gRPC and both KV-event sockets on port 0: the ports file (written once all listen)
    names each bound port, each takes a connection at once, and /server_info describes the
    KV-event endpoint with its bound port."""
    ports_file = tmp_path / "ports.json"
    events = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": True,
              "replay_endpoint": "tcp://127.0.0.1:0"}
    proc = subprocess.Popen([sys.executable, "-m", "decode_worker", "serve", "--port", "0",
                             "--grpc-port", "0", "--kv-events-config", json.dumps(events),
                             "--ports-file", str(ports_file), "--set", "cache.num_full_pages=64",
                             "--set", "cache.num_swa_pages=32",
                             "--set", "server.drain_announce_s=0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ports_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ports = json.loads(ports_file.read_text())
        assert set(ports) == {"http", "grpc", "kv_events", "kv_events_replay"}, ports
        assert len(set(ports.values())) == 4 and 0 not in ports.values(), ports
        for port in ports.values():  # listening already: no wait after the file
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        base = f"http://127.0.0.1:{ports['http']}"
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        info = httpx.get(f"{base}/server_info", timeout=5).json()["kv_events"]
        assert info["endpoint_port_base"] == ports["kv_events"]
        assert info["replay_endpoint_port_base"] == ports["kv_events_replay"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_print_config_shows_what_serves_own_flags_resolve_to() -> None:
    done = _cli("serve", "--port", "30123", "--host", "0.0.0.0", "--set",
                "server.drain_grace_s=20", "--print-config")
    assert done.returncode == 0, done.stderr
    rows = {line.split("=")[0].strip(): line for line in done.stdout.splitlines()}
    assert rows["server.port"].endswith("= 30123  # cli")
    assert rows["server.host"].endswith('= "0.0.0.0"  # cli')
    assert rows["server.drain_grace_s"].endswith("= 20.0  # cli")
    assert rows["server.drain_announce_s"].endswith("# default")
