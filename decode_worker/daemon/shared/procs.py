"""Child server processes and a tiny stdlib HTTP client, for the demo and end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

from decode_worker.errors import DecodeWorkerError

ANNOUNCE_ENV = "DECODE_WORKER_SERVER__DRAIN_ANNOUNCE_S"


class ServerProcess:
    """`decode-worker <args>` as a child process; a context manager that stops it (SIGTERM,
    then SIGKILL) on exit, also when starting it failed. Its output goes to a temp file, shown
    if it fails to start.

    Ports are race-free: the child is given `--ports-file` and writes the ports it bound once
    it serves; `wait_ready` reads them (`ports`: "http", "grpc" with `--grpc-port`, a prefill
    peer's "bootstrap" and "rank", a decode worker's "kv_events" / "kv_events_replay" with a
    bound KV-event endpoint) and sets `port` and `url`. So `args` may say `--port 0` (and
    `--bootstrap-port 0`, `--grpc-port 0`, a KV-event endpoint on port 0): the child binds any
    free port, and no other process can take it between a pick and a bind.
    The drain's announce window (`server.drain_announce_s`) defaults to 0 here (nothing routes
    to these children); `env` or `--set` may give one."""

    def __init__(self, name: str, args: list[str], port: int = 0, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None, grpc_port: int | None = None,
                 cwd: str | None = None) -> None:
        """`grpc_port`: a fixed port its `--grpc-port` serves smg's gRPC protocol on, known
        before it starts (`--grpc-port 0` needs none: the bound one is reported); `cwd`: its
        working directory (default: this process's)."""
        self.name, self.args, self.port, self.host = name, args, port, host
        self.cwd = cwd
        self.ports: dict[str, int] = {"http": port} if port else {}
        if grpc_port:
            self.ports["grpc"] = grpc_port
        self.env = {ANNOUNCE_ENV: "0", **os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
            prefix=f"dw-{name}-", suffix=".log", delete=False)
        self.ports_file = f"{self.log.name}.ports.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self._signalled: tuple[int, int] = (0, 0)  # (pid, signal) signal_stop sent last

    @property
    def url(self) -> str:
        """http://host:port (the bound port once `wait_ready` returned)."""
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_port(self) -> int | None:
        """The gRPC port (`--grpc-port`): the bound one once `wait_ready` returned; None
        without gRPC or before a port-0 child reported."""
        return self.ports.get("grpc")

    @property
    def grpc_target(self) -> str | None:
        """host:port of the gRPC port (grpc.aio's address), None as `grpc_port`."""
        port = self.grpc_port
        return f"{self.host}:{port}" if port else None

    def __enter__(self) -> Self:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.ports_file)  # a restart reports afresh
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "decode_worker", *self.args, "--ports-file", self.ports_file],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the ports file, then poll GET /health until 200; raises with the server's
        log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise DecodeWorkerError(f"{self.name} exited with {self.proc.returncode}:\n"
                                        f"{self.output()[-4000:]}")
            if self._read_ports():
                try:
                    http_json(f"{self.url}/health", timeout_s=2.0)
                    return
                except (OSError, DecodeWorkerError):
                    pass
            time.sleep(0.1)
        raise DecodeWorkerError(f"{self.name} not ready in {timeout_s}s:\n{self.output()[-4000:]}")

    def _read_ports(self) -> bool:
        """Whether the child reported its ports (then in `ports` and `port`)."""
        try:
            with open(self.ports_file, encoding="utf-8") as f:
                self.ports = {k: int(v) for k, v in json.load(f).items()}
        except FileNotFoundError:
            return False
        self.port = self.ports["http"]
        return True

    def signal_stop(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to a running process without waiting; a `stop()` with the same signal
        after it only waits (a second SIGTERM would cut the drain short)."""
        if self.proc is not None and self.proc.poll() is None and (
                self._signalled != (self.proc.pid, sig)):
            self.proc.send_signal(sig)
            self._signalled = (self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int | None:
        """Signal the process (unless `signal_stop` did) and wait for it (SIGKILL after
        `timeout_s`); its exit code."""
        try:
            if self.proc is None or self.proc.poll() is not None:
                return None if self.proc is None else self.proc.returncode
            self.signal_stop(sig)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        finally:
            self.log.close()  # output() reads the file by name
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.ports_file)

    def again(self) -> ServerProcess:
        """A new (not started) ServerProcess with the same arguments, the ports it bound in
        place of 0 in `--port` / `--bootstrap-port` / `--grpc-port`: a restart behind the
        same address."""
        names = {"--port": "http", "--bootstrap-port": "bootstrap", "--grpc-port": "grpc"}
        args = list(self.args)
        for i, arg in enumerate(args[:-1]):
            if arg in names and args[i + 1] == "0" and names[arg] in self.ports:
                args[i + 1] = str(self.ports[names[arg]])
        again = ServerProcess(self.name, args, self.port, self.host, self.env, None, self.cwd)
        again.ports = dict(self.ports)  # the same ports, known before it reports them
        return again

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()


class PdServers:
    """One prefill peer (`prefill`) and `num_decode` decode workers (`decodes`: "decode",
    "decode1", ...) as child processes on loopback, each on ports it bound itself; a context
    manager that starts them all, waits until each answers /health, and stops them (decode
    workers first), also when one failed to start. `common`: arguments of every server;
    `prefill_args` (before `common`) and `decode_args` (after it): one side's. `prefill_port`
    and `boot_port` (the prefill's HTTP and bootstrap ports) are known once entered. `grpc`:
    every server also serves smg's gRPC protocol (`--grpc-port`, a free port picked here:
    `ServerProcess.grpc_port` / `grpc_target`)."""

    def __init__(self, common: Sequence[str], num_decode: int = 1, *,
                 prefill_args: Sequence[str] = (), decode_args: Sequence[str] = (),
                 ready_timeout_s: float = 120.0, grpc: bool = False) -> None:
        grpc_args = ["--grpc-port", "0"] if grpc else []
        self.prefill = ServerProcess("prefill", [
            "prefill", "--port", "0", "--bootstrap-port", "0", *grpc_args, *prefill_args,
            *common])
        self.decodes: list[ServerProcess] = []
        for i in range(num_decode):
            self.decodes.append(ServerProcess(f"decode{i}" if i else "decode", [
                "serve", "--port", "0", *grpc_args, *common, *decode_args]))
        self.ready_timeout_s = ready_timeout_s

    @property
    def prefill_port(self) -> int:
        return self.prefill.port

    @property
    def boot_port(self) -> int:
        return self.prefill.ports["bootstrap"]

    def __enter__(self) -> Self:
        try:
            for proc in (self.prefill, *self.decodes):
                proc.__enter__()
            for proc in (self.prefill, *self.decodes):
                proc.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.decodes:  # they drain at once: the wait is the longest, not the sum
            proc.signal_stop()
        for proc in (*self.decodes, self.prefill):
            proc.stop()


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> Any:
    """GET (no body) or POST JSON; returns the decoded JSON. Raises DecodeWorkerError on a
    non-2xx answer, with the status and body."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise DecodeWorkerError(f"{url}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None
    return json.loads(raw) if raw else None


def wait_router_workers(router_url: str, count: int, timeout_s: float,
                        alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll a router's GET /workers until it lists at least `count` healthy workers (True), or
    `timeout_s` passes or `alive()` turns false (False). A worker without `is_healthy` (older
    routers) counts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            listed = http_json(f"{router_url}/workers", timeout_s=2)
            workers = listed.get("workers", listed) if isinstance(listed, dict) else listed
            healthy = [w for w in workers if not isinstance(w, dict) or w.get("is_healthy", True)]
            if isinstance(workers, list) and len(healthy) >= count:
                return True
        except Exception:  # not up yet, or answering oddly while it starts
            pass
        time.sleep(0.5)
    return False


def scrape_metric(base_url: str, name: str, labels: str = "") -> float:
    """Sum of the samples of `name` (with `labels` as a substring of the label set, if given)
    on base_url/metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it). Racy: another process
    may take it before the caller binds it. Only for what cannot bind port 0 and report it
    (a router: retry on failure, see router.Router) or a port nothing will listen on."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
