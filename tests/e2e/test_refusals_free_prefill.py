"""A request the decode worker refuses at its door ends the prefill peer's copy at once, with
both peer protocols: the prefill answers well under its `kv_timeout_s` (30 s here), with a
non-success status, and the decode worker's counters name the refusal.

Played as the router plays it: the same body (and room) to the prefill peer and to the decode
worker at once. The decode worker is set up to refuse what the prefill accepts: a prompt over
`scheduler.max_prompt_tokens` (413 too_large), tools with `api.tool_call_parser=none` (400), a
second request while one waits for its KV with `scheduler.max_queued_requests=1` (503
queue_full), and a new request while it drains (503 drain).
"""

from __future__ import annotations

import json
import random
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from decode_worker.daemon.shared.procs import ServerProcess, scrape_metric
from tests.e2e.driver import Workers

pytestmark = pytest.mark.slow
KV_TIMEOUT_S = 30.0
PROMPT_LIMIT = 256  # a chat prompt with a tool is ~110 tokens
PROMPTLY_S = 5.0  # the prefill's answer, measured from when both copies were sent
DECODE_ONLY = ["--set", f"scheduler.max_prompt_tokens={PROMPT_LIMIT}",
               "--set", "api.tool_call_parser=none", "--set", "scheduler.max_queued_requests=1"]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module", params=["native", "sglang"])
def pd(request: pytest.FixtureRequest, e2e_model_dir: Path) -> Iterator[Workers]:
    with Workers(e2e_model_dir, router=False, protocol=request.param,
                 extra=["--set", f"scheduler.kv_timeout_s={KV_TIMEOUT_S}"],
                 decode_extra=DECODE_ONLY) as w:
        yield w


def prompt(n: int) -> list[int]:
    return [random.randrange(3, 250) for _ in range(n)]


def aborts(url: str, reason: str) -> float:
    return scrape_metric(url, "decode_worker_aborts_total", f'reason="{reason}"')


def wait_aborts(url: str, reason: str, want: float, timeout_s: float = 10.0) -> None:
    """The engine publishes its counts every idle step: wait (bounded) for `want`."""
    deadline = time.monotonic() + timeout_s
    while aborts(url, reason) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts(url, reason) == want


def timed_post(url: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    resp = httpx.post(url, json=body, timeout=KV_TIMEOUT_S + 15)
    return resp, time.monotonic()


def both(w: Workers, decode_url: str, path: str, body: dict[str, Any],
         ) -> tuple[httpx.Response, httpx.Response, float]:
    """The router's part: `body` with a new room to the prefill and the decode worker at once.
    Returns the decode's answer, the prefill's, and how long the prefill took."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": w.boot_port,
            "bootstrap_room": random.getrandbits(63)}
    with ThreadPoolExecutor(max_workers=1) as pool:
        sent = time.monotonic()
        pre: Future[tuple[httpx.Response, float]] = pool.submit(
            timed_post, f"{w.prefill.url}{path}", body)
        dec = httpx.post(f"{decode_url}{path}", json=body, timeout=KV_TIMEOUT_S + 15)
        pre_resp, pre_at = pre.result(timeout=KV_TIMEOUT_S + 20)
    return dec, pre_resp, pre_at - sent


def assert_prefill_freed(pre: httpx.Response, took: float, protocol: str, status: int) -> None:
    assert took < PROMPTLY_S, f"the prefill answered after {took:.1f}s: {pre.text[:300]}"
    assert pre.status_code >= 400, pre.text[:300]
    if protocol == "native":  # the native peer answers with the decode side's status
        assert pre.status_code == status, pre.text[:300]


def test_a_prompt_over_max_prompt_tokens_frees_the_prefill(pd: Workers) -> None:
    url, before = pd.decode.url, aborts(pd.decode.url, "too_large")
    body = {"input_ids": prompt(PROMPT_LIMIT + 36), "sampling_params": {"max_new_tokens": 4}}
    dec, pre, took = both(pd, url, "/generate", body)
    assert dec.status_code == 413 and dec.json()["error"]["reason"] == "too_large", dec.text
    assert_prefill_freed(pre, took, protocol_of(pd), 413)
    wait_aborts(url, "too_large", before + 1)


def test_a_400_at_the_decode_door_frees_the_prefill(pd: Workers) -> None:
    url, before = pd.decode.url, aborts(pd.decode.url, "bad_request")
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [TOOL],
            "max_tokens": 4}
    dec, pre, took = both(pd, url, "/v1/chat/completions", body)
    assert dec.status_code == 400 and "tool" in dec.text, dec.text
    assert_prefill_freed(pre, took, protocol_of(pd), 400)
    wait_aborts(url, "bad_request", before + 1)


def test_a_full_queue_frees_the_prefill(pd: Workers) -> None:
    """One request waits for KV that never comes (its room sent to the decode worker only),
    so the queue of 1 is full; the next request is refused at once and so is its prefill copy.
    The waiting one ends when its client leaves."""
    url, before = pd.decode.url, aborts(pd.decode.url, "queue_full")
    waiting = hold_waiting_request(pd, url)
    try:
        dec, pre, took = both(pd, url, "/generate",
                              {"input_ids": prompt(40), "sampling_params": {"max_new_tokens": 4}})
    finally:
        waiting.close()  # client_abort: the worker's queue is empty again
    assert dec.status_code == 503 and dec.json()["error"]["reason"] == "queue_full", dec.text
    assert_prefill_freed(pre, took, protocol_of(pd), 503)
    wait_aborts(url, "queue_full", before + 1)
    wait_idle(url)


def test_draining_frees_the_prefill(pd: Workers, e2e_model_dir: Path) -> None:
    """A worker of its own drains (SIGTERM, a long request in hand, 10 s of grace); a request
    it refuses while draining is ended at the prefill at once."""
    args = ["serve", "--port", "0", "--model", str(e2e_model_dir),
            "--set", "cache.page_size=16", "--set", f"scheduler.kv_timeout_s={KV_TIMEOUT_S}",
            "--set", "server.drain_grace_s=10"]
    long_body = {"input_ids": prompt(20),
                 "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with ServerProcess("decode-drain", args) as proc, ThreadPoolExecutor(1) as pool:
        proc.wait_ready(120)
        assert proc.proc is not None
        long = pool.submit(_quietly, httpx.post, f"{proc.url}/generate", json=long_body,
                           timeout=60)
        wait_until(lambda: load(proc.url)["num_reqs"] >= 1, "the long request never started")
        proc.proc.send_signal(signal.SIGTERM)
        dec, pre, took = refused_while_draining(pd, proc.url)
        assert dec.json()["error"]["reason"] == "drain", dec.text
        assert_prefill_freed(pre, took, protocol_of(pd), 503)
        wait_aborts(proc.url, "drain", 1)
        proc.stop()  # a second signal: it exits at once
        long.result(timeout=30)


def _quietly(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """`fn(...)`, or None if it raised (the long request dies with its worker)."""
    try:
        return fn(*args, **kw)
    except httpx.HTTPError:
        return None


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def refused_while_draining(pd: Workers, url: str,
                           ) -> tuple[httpx.Response, httpx.Response, float]:
    """Requests until the draining worker refuses one (it may first serve through a window in
    which routers learn of the drain); bounded."""
    deadline = time.monotonic() + 9.0
    while True:
        dec, pre, took = both(pd, url, "/generate",
                              {"input_ids": prompt(30), "sampling_params": {"max_new_tokens": 2}})
        if dec.status_code == 503 or time.monotonic() > deadline:
            return dec, pre, took
        assert dec.status_code == 200, dec.text


def protocol_of(w: Workers) -> str:
    return w.prefill.args[w.prefill.args.index("--protocol") + 1]


class _Held:
    """A /generate request on a raw socket, left waiting; `close()` hangs up."""

    def __init__(self, port: int, body: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: " + str(len(body)).encode()
                          + b"\r\n\r\n" + body)

    def close(self) -> None:
        self.sock.close()


def hold_waiting_request(w: Workers, url: str) -> _Held:
    """A request waiting at the decode worker for KV its prefill never heard of."""
    body = {"input_ids": prompt(40), "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": w.boot_port,
            "bootstrap_room": random.getrandbits(63)}
    held = _Held(int(url.rsplit(":", 1)[1]), json.dumps(body).encode())
    deadline = time.monotonic() + 10
    while load(url)["num_waiting_reqs"] < 1:
        assert time.monotonic() < deadline, "the held request never waited"
        time.sleep(0.05)
    return held


def load(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/get_load", timeout=10).json()[0])


def wait_idle(url: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while load(url)["num_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load(url)["num_reqs"] == 0
