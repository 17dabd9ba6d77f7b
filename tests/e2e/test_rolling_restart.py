"""A rolling restart behind the SGLang Model Gateway loses no request.

One prefill peer and two decode workers (real processes, NIXL on loopback) behind smg 1.13 with
the flags docs/DEPLOY.md gives for rolling restarts (`router.ROLLING_RESTART_FLAGS`: health
checks every 2 s, out after 2 failures, the circuit breaker on) and the example's sticky
routing (cache_aware, `--routing-key-override`, min_group). Clients send steady keyed traffic
(`X-SMG-Routing-Key`, one key per client) while the decode worker that holds a long request
gets SIGTERM with the default announce window (`server.drain_announce_s`), drains, exits, and
starts again on its port. Every steady request is answered 200 (the long one is answered too:
200, or 503 `drain` when the grace ended it), smg's circuit breaker never opens, the stopped
worker waited out its window, and the restarted worker serves again.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from decode_worker.daemon.shared.procs import PdServers, free_port, scrape_metric
from decode_worker.daemon.shared.router import (
    ROLLING_RESTART_FLAGS,
    SMG,
    Router,
    has_router,
    router_argv,
)
from decode_worker.settings import ServerSettings

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed")]
ANNOUNCE_S = float(ServerSettings.model_fields["drain_announce_s"].default)
CLIENTS, MAX_NEW = 4, 4
LONG_NEW = 4000  # far past the 5 s grace on the tiny CPU model
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # smg colours its log
EXAMPLE_FLAGS = ("--decode-policy", "cache_aware", "--routing-key-override",
                 "--assignment-mode", "min_group", "--disable-worker-overload-protection")


class Traffic:
    """`CLIENTS` threads, each sending /generate through the router with its own routing key,
    one request after the other, until `stop()`; every answer's status is kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, int, str]] = []  # (time, status, body head)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(CLIENTS)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _client(self, i: int) -> None:
        headers = {"X-SMG-Routing-Key": f"conversation-{i}"}
        with httpx.Client(timeout=60, headers=headers) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body: dict[str, Any] = {
                    "input_ids": [3 + i, *range(10, 40), n % 200 + 3],
                    "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                        "ignore_eos": True}}
                try:
                    resp = client.post(f"{self.url}/generate", json=body)
                    self.answers.append((time.monotonic(), resp.status_code, resp.text[:300]))
                except httpx.HTTPError as exc:
                    self.answers.append((time.monotonic(), 0, repr(exc)))
                time.sleep(0.05)

    def count_since(self, t0: float) -> int:
        return sum(1 for t, _, _ in list(self.answers) if t >= t0)


@pytest.fixture
def stack(e2e_model_dir: Path) -> Iterator[tuple[PdServers, Router]]:
    announce = ["--set", f"server.drain_announce_s={ANNOUNCE_S}",
                "--set", "server.drain_grace_s=5"]
    with PdServers(["--model", str(e2e_model_dir), "--set", "cache.page_size=16"], 2,
                   decode_args=announce) as servers:
        port = free_port()  # a taken one makes wait_workers retry on another
        argv = router_argv(SMG, [(servers.prefill.url, servers.boot_port)],
                           [d.url for d in servers.decodes], port, policy="round_robin",
                           request_timeout_s=180, circuit_breaker=True,
                           extra=[*EXAMPLE_FLAGS, *ROLLING_RESTART_FLAGS])
        with Router(argv, port) as router:
            router.wait_workers(3, 60)
            yield servers, router


def _long_request(url: str) -> tuple[int, str]:
    """A long /generate through the router; its status and body head (0: no answer). smg
    retries the drain's 503 on the other worker, so the answer may take two runs of it."""
    body = {"input_ids": [5, *range(50, 90)], "sampling_params": {
        "max_new_tokens": LONG_NEW, "temperature": 0, "ignore_eos": True}}
    try:
        resp = httpx.post(f"{url}/generate", json=body, timeout=200)
        return resp.status_code, resp.text[:300]
    except httpx.HTTPError as exc:
        return 0, repr(exc)


def _holder(servers: PdServers, timeout_s: float = 30.0) -> int:
    """The index of the decode worker that runs the long request (sent before any other)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, d in enumerate(servers.decodes):
            if httpx.get(f"{d.url}/get_load", timeout=5).json()[0]["num_reqs"] >= 1:
                return i
        time.sleep(0.1)
    raise AssertionError("no decode worker runs the long request")


def _wait_served(traffic: Traffic, t0: float, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while traffic.count_since(t0) < n and time.monotonic() < deadline:
        time.sleep(0.1)


def _wait_healthy_in_router(router: Router, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(f"{router.url}/workers", timeout=5).json()
        rows = workers.get("workers", workers) if isinstance(workers, dict) else workers
        if any(w.get("url") == url and w.get("is_healthy", True) for w in rows):
            return
        time.sleep(0.2)
    raise AssertionError(f"smg never listed {url} as healthy again:\n{router.output()[-3000:]}")


def test_rolling_restart_of_a_decode_worker_behind_smg_fails_no_request(
        stack: tuple[PdServers, Router]) -> None:
    servers, router = stack
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(_long_request, router.url)
        i = _holder(servers)  # the long request is in hand there: drain that worker
        old = servers.decodes[i]
        assert old.proc is not None
        with Traffic(router.url) as traffic:
            _wait_served(traffic, 0.0, 2 * CLIENTS, 60)
            signalled = time.monotonic()
            old.proc.send_signal(signal.SIGTERM)
            assert old.proc.wait(ANNOUNCE_S + 5 + 15) == 0, old.output()[-3000:]
            stopped_after = time.monotonic() - signalled
            old.stop()
            new = servers.decodes[i] = old.again()
            new.__enter__()
            new.wait_ready(120)
            _wait_healthy_in_router(router, new.url, 30)
            back = time.monotonic()
            _wait_served(traffic, back, 4 * CLIENTS, 60)
        long_status, long_text = long.result(timeout=210)
    failed = [a for a in traffic.answers if a[1] != 200]
    log = ANSI.sub("", router.output())
    assert not failed, f"{len(failed)} of {len(traffic.answers)} failed: {failed[:5]}\n" \
                       f"{log[-3000:]}"
    assert long_status == 200 or (long_status == 503 and '"drain"' in long_text), long_text
    assert "-> open" not in log, f"smg opened a circuit breaker:\n{log[-3000:]}"
    assert stopped_after >= ANNOUNCE_S, f"stopped {stopped_after:.1f}s after SIGTERM"
    served_new = scrape_metric(new.url, "decode_worker_requests_total")
    assert served_new > 0, "smg sends nothing to the restarted worker"
