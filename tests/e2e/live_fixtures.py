"""Helpers for the live tests: one real `decode-worker serve` child on loopback, driven over HTTP.

`live_server(model_dir, *extra_args)` starts the daemon with small pools on a free port and
yields a `Live` handle (httpx helpers, SSE reader, /metrics parser); it stops the process on
exit. Every wait here is bounded. Requests without `bootstrap_*` are prefilled by the worker
itself, so no prefill peer is needed.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.daemon.shared.procs import ServerProcess

SMALL_POOLS = ("--set", "cache.num_full_pages=512", "--set", "cache.num_swa_pages=128")
DONE = "[DONE]"
IDLE_QUEUES = ("prealloc", "transfer", "running")


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class Metrics:
    """One /metrics scrape: samples, and the family -> type map of its `# TYPE` lines."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: list[Sample] = []
        self.types: dict[str, str] = {}
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            self.samples += [Sample(s.name, dict(s.labels), float(s.value)) for s in fam.samples]

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return sum(s.value for s in self.samples if s.name == name
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    def names(self) -> set[str]:
        return {s.name for s in self.samples}

    def pool(self, pool: str) -> dict[str, float]:
        """available/used/evictable/protected/total pages of one pool ("total": the
        `decode_worker_kv_pages_capacity` gauge)."""
        named = {"available": "available", "used": "used", "evictable": "evictable",
                 "protected": "protected", "total": "capacity"}
        return {what: self.value(f"decode_worker_kv_pages_{name}", pool=pool)
                for what, name in named.items()}


class Live:
    """A running server: its process, URL and a keep-alive httpx client."""

    def __init__(self, proc: ServerProcess, api_key: str | None = None) -> None:
        self.proc = proc
        self.url = proc.url
        self.port = proc.port
        auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=proc.url, timeout=httpx.Timeout(60.0, connect=5.0),
                                 headers=auth)

    def close(self) -> None:
        self.http.close()

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, path: str, body: Any = None, *, raw: bytes | None = None,
             timeout_s: float = 60.0) -> httpx.Response:
        content = raw if raw is not None else json.dumps(body).encode()
        return self.http.post(path, content=content, timeout=timeout_s,
                              headers={"content-type": "application/json"})

    def sse(self, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> list[Any]:
        """POST a streaming request; the parsed `data:` events in order ("[DONE]" as a str)."""
        with self.http.stream("POST", path, json=body, timeout=timeout_s) as resp:
            assert resp.status_code == 200, resp.read()
            assert resp.headers["content-type"].startswith("text/event-stream")
            return [parse_event(e) for e in read_events(resp.iter_lines())]

    def metrics(self) -> Metrics:
        resp = self.get("/metrics")
        assert resp.status_code == 200
        return Metrics(resp.text)

    def wait_idle(self, timeout_s: float = 20.0) -> Metrics:
        """Poll /metrics until no request is queued or running; returns the last scrape."""
        return idle_metrics(self.url, timeout_s)


def idle_metrics(url: str, timeout_s: float = 30.0) -> Metrics:
    """Poll the worker's /metrics until no request is queued, transferring or running; the
    last scrape (also at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            m = Metrics(resp.read().decode())
        busy = sum(m.value("decode_worker_queue_requests", queue=q) for q in IDLE_QUEUES)
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def read_events(lines: Iterator[str]) -> Iterator[str]:
    """SSE `data:` payloads from a line iterator (one event per `data:` line)."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


def parse_event(payload: str) -> Any:
    return payload if payload == DONE else json.loads(payload)


@contextmanager
def live_server(model_dir: Path, *extra: str, port: int = 0, name: str = "live",
                api_key: str | None = None) -> Iterator[Live]:
    """`decode-worker serve --model DIR` with small pools on `port` (0: any free port, which
    the server reports); stopped (SIGTERM) on exit. With `api_key`, the server requires it
    (env DECODE_WORKER_SERVER__API_KEY) and the handle's client sends it."""
    args = ["serve", "--model", str(model_dir), "--port", str(port), *SMALL_POOLS, *extra]
    env = {"DECODE_WORKER_SERVER__API_KEY": api_key} if api_key else None
    proc = ServerProcess(name, args, port, env=env)
    live = None
    try:
        with proc:
            proc.wait_ready(120)
            live = Live(proc, api_key)
            yield live
    finally:
        if live is not None:
            live.close()
        proc.log.close()


def gen_body(ids: list[int], max_new: int, **extra: Any) -> dict[str, Any]:
    """A greedy /generate body that produces exactly `max_new` tokens."""
    return {"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, **extra}


def raw_stream(port: int, path: str, body: dict[str, Any], events: int,
               timeout_s: float = 30.0) -> socket.socket:
    """Open a streaming POST on a raw socket and read until `events` SSE events arrived;
    the caller closes the socket (a client disconnect)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    buf = b""
    try:
        while buf.count(b"data:") < events:
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError(f"stream closed early: {buf[-500:]!r}")
            buf += chunk
    except BaseException:
        sock.close()
        raise
    return sock


def pool_is_whole(m: Metrics) -> list[str]:
    """Problems if a pool's free + evictable pages do not add up to its total, or some page
    is still protected (held by a request), once the worker is idle; the landing area (SGLang
    prefills of an all-layer model; absent: all zero) caches nothing, so all of it is free."""
    out = []
    for pool in ("full", "swa", "landing"):
        p = m.pool(pool)
        if p["available"] + p["evictable"] != p["total"] or p["protected"] != 0:
            out.append(f"{pool}: {p}")
        if p["used"] != p["evictable"]:  # used pages are the tree-cached ones only
            out.append(f"{pool}: used != evictable: {p}")
    return out
