"""A router in PD mode in front of child servers, for the demo, the end-to-end tests and the
benchmarks: the SGLang Model Gateway (`smg`, PyPI `smg` 1.13, the router of record) or the older
`sglang-router` 0.3.2 (kept for one compatibility test).

Both are started as modules (`python -m smg.launch_router`, `python -m
sglang_router.launch_router`), never through a console script: sglang-router 0.3.2 also installs
a `smg` script, so with both packages installed `smg` on PATH is whichever was installed last
(and uninstalling sglang-router deletes smg's). The flags used here mean the same to both.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from decode_worker.daemon.shared.harmony_vocab import harmony_vocab_env
from decode_worker.daemon.shared.procs import ServerProcess, free_port, wait_router_workers
from decode_worker.errors import DecodeWorkerError

log = logging.getLogger(__name__)

SMG = "smg"
SGLANG_ROUTER = "sglang-router"
MODULES = {SMG: "smg.launch_router", SGLANG_ROUTER: "sglang_router.launch_router"}
PACKAGES = {SMG: "smg", SGLANG_ROUTER: "sglang_router"}
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual",
            "consistent_hashing", "prefix_hash")
# smg flags for rolling restarts of decode workers (docs/DEPLOY.md, "Rolling restarts"): a
# worker that drains answers /health 503 for `server.drain_announce_s` (6 s by default) while it
# still serves; smg probes every 2 s and takes a worker out after 2 failed probes, so within
# 4 s, before the worker refuses anything (and back after 1 good probe). The circuit breaker
# stays on for workers that fail requests while their /health says 200, with a short open time
# (10 s) so one bad burst does not shut a worker out for smg's default 60 s.
ROLLING_RESTART_FLAGS = (
    "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
    "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
    "--cb-failure-threshold", "10", "--cb-window-duration-secs", "30",
    "--cb-timeout-duration-secs", "10",
)


def has_router(kind: str = SMG) -> bool:
    """Whether the router package `kind` (smg or sglang-router) can be imported."""
    return importlib.util.find_spec(PACKAGES[kind]) is not None


def router_argv(kind: str, prefills: Sequence[tuple[str, int | None]], decodes: Sequence[str],
                port: int, *, policy: str = "round_robin", decode_policy: str | None = None,
                health_interval_s: int = 3, request_timeout_s: int = 60,
                circuit_breaker: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The command line of router `kind` in PD mode on 127.0.0.1:`port`: `prefills` as (URL,
    bootstrap port), `decodes` as URLs (`grpc://host:port` for smg's gRPC mode); Prometheus on
    a free loopback port; the circuit breaker off unless `circuit_breaker` (one failing test
    must not open it for the next);
    `extra` last (a flag given again there wins). Raises DecodeWorkerError for an unknown
    router or policy."""
    if kind not in MODULES:
        raise DecodeWorkerError(f"unknown router {kind!r}; known: {sorted(MODULES)}")
    for name in (policy, decode_policy):
        if name is not None and name not in POLICIES:
            raise DecodeWorkerError(f"unknown router policy {name!r}; known: {POLICIES}")
    argv = [sys.executable, "-m", MODULES[kind], "--pd-disaggregation"]
    for url, boot in prefills:
        argv += ["--prefill", url, "none" if boot is None else str(boot)]
    for url in decodes:
        argv += ["--decode", url]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
             "--health-check-interval-secs", str(health_interval_s),
             "--request-timeout-secs", str(request_timeout_s), "--policy", policy]
    if not circuit_breaker:
        argv.append("--disable-circuit-breaker")
    if decode_policy is not None:
        argv += ["--decode-policy", decode_policy]
    if kind == SMG:  # load reports (GET /v1/loads) every second rather than every 10
        argv += ["--load-monitor-interval", "1"]
    return [*argv, *extra]


class Router(ServerProcess):
    """A router child process (see `router_argv`); `wait_workers` blocks until it lists them.
    Stopped like any ServerProcess (SIGTERM, then SIGKILL).

    A router cannot bind port 0 and report it, so its ports (`--port`, `--prometheus-port`)
    come from `free_port`, which another process may take first: when the router exits because
    a port was taken, `wait_workers` starts it again on fresh ports (`port` and `url` follow)."""

    BIND_TRIES = 3

    def __init__(self, argv: list[str], port: int, name: str = "router",
                 cwd: str | None = None) -> None:
        # gRPC workers: smg loads the harmony encoding for gpt-oss before it registers them
        env = harmony_vocab_env() if any(a.startswith("grpc://") for a in argv) else None
        super().__init__(name, [], port, env=env, cwd=cwd)
        self.cmd = argv

    def __enter__(self) -> Router:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=self.cwd)
        return self

    def stop(self, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int | None:
        """SIGKILL by default: a test or benchmark router holds nothing worth a graceful stop,
        and on SIGTERM smg keeps its listener open 5 s more (its drain settle window)."""
        return super().stop(sig, timeout_s)

    def wait_workers(self, count: int, timeout_s: float) -> None:
        """Until GET /workers lists `count` workers; raises DecodeWorkerError with the
        router's log when it exits (but for a taken port, see the class) or `timeout_s`
        passes."""
        deadline = time.monotonic() + timeout_s
        for _ in range(self.BIND_TRIES):
            if wait_router_workers(self.url, count, deadline - time.monotonic(), self._alive):
                return
            if self._alive() or "Address already in use" not in self.output():
                break
            log.warning("%s: a port was taken; starting it again on fresh ports", self.name)
            self._restart_on_fresh_ports()
        code = None if self.proc is None else self.proc.poll()
        raise DecodeWorkerError(f"router has not listed {count} workers after {timeout_s}s "
                                f"(exit code {code}):\n{self.output()[-3000:]}")

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _restart_on_fresh_ports(self) -> None:
        cmd = list(self.cmd)
        for i, arg in enumerate(cmd[:-1]):
            if arg in ("--port", "--prometheus-port"):
                cmd[i + 1] = str(free_port())
                if arg == "--port":
                    self.port = int(cmd[i + 1])
        self.cmd = cmd
        self.__enter__()
