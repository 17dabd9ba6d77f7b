"""A bounded mixed workload against a prefill peer + decode worker with small pools: normal P/D
turns sharing prefixes, local requests, client disconnects, orphan rooms and bad input, all at
once. The worker checks its pages and locks every 0.2 s between batches (a broken invariant
stops it), and must end idle with every page free or cached."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.procs import http_json, scrape_metric
from decode_worker.errors import DecodeWorkerError
from tests.e2e.driver import Workers
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
SYSTEM = [random.Random(7).randrange(3, 250) for _ in range(160)]


@pytest.fixture
def workers(e2e_model_dir: Path) -> Iterator[Workers]:
    extra = ["--set", "scheduler.kv_timeout_s=3", "--set", "transfer.abort_quiesce_s=2",
             "--set", "scheduler.integrity_check_interval_s=0.2",
             "--set", "cache.num_full_pages=160", "--set", "cache.num_swa_pages=64",
             "--set", "scheduler.decode_reserve_tokens=0"]
    with Workers(e2e_model_dir, router=False, extra=extra) as w:
        yield w


def _pd(w: Workers, rng: random.Random) -> str:
    prompt = SYSTEM + [rng.randrange(3, 250) for _ in range(rng.randrange(10, 120))]
    body = {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": rng.randrange(1, 40), "temperature": 0}, "bootstrap_host":
        "127.0.0.1", "bootstrap_port": w.boot_port, "bootstrap_room": rng.getrandbits(63)}
    with ThreadPoolExecutor(1) as pool:
        pre = pool.submit(http_json, f"{w.prefill.url}/generate", body)
        out = http_json(f"{w.decode.url}/generate", body)
        pre.result()
    return "ok" if out["output_ids"] else "empty"


def _disconnect(w: Workers, rng: random.Random) -> str:
    body = json.dumps({"input_ids": SYSTEM[:50], "stream": True, "sampling_params": {
        "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}).encode()
    with socket.create_connection(("127.0.0.1", w.decode_port), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        sock.recv(512)  # the head (and maybe the first event), then hang up
    return "gone"


def _orphan(w: Workers, rng: random.Random) -> str:
    body = {"input_ids": SYSTEM[:80], "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": w.boot_port,
            "bootstrap_room": rng.getrandbits(63)}
    try:
        http_json(f"{w.decode.url}/generate", body)
    except DecodeWorkerError as exc:
        return "timeout" if "kv_timeout" in str(exc) else f"other: {exc}"
    return "unexpected success"


def _bad(w: Workers, rng: random.Random) -> str:
    try:
        http_json(f"{w.decode.url}/generate", {"input_ids": [1, 10**6]})
    except DecodeWorkerError as exc:
        return "400" if "HTTP 400" in str(exc) else f"other: {exc}"
    return "unexpected success"


def _local(w: Workers, rng: random.Random) -> str:
    out = http_json(f"{w.decode.url}/generate", {"input_ids": SYSTEM[: rng.randrange(5, 150)],
                                                 "sampling_params": {"max_new_tokens": 8}})
    return "ok" if len(out["output_ids"]) <= 8 else "too long"


KINDS: dict[str, Any] = {"pd": _pd, "disconnect": _disconnect, "orphan": _orphan, "bad": _bad,
                         "local": _local}
EXPECTED = {"pd": {"ok"}, "disconnect": {"gone"}, "orphan": {"timeout"}, "bad": {"400"},
            "local": {"ok"}}


def test_mixed_workload_keeps_the_books_balanced(workers: Workers) -> None:
    rng = random.Random(0)
    plan = ["pd"] * 24 + ["local"] * 8 + ["disconnect"] * 6 + ["orphan"] * 3 + ["bad"] * 3
    rng.shuffle(plan)
    seeds = [rng.getrandbits(32) for _ in plan]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda ks: (ks[0], KINDS[ks[0]](workers, random.Random(ks[1]))),
                                zip(plan, seeds, strict=True)))
    for kind, outcome in results:
        assert outcome in EXPECTED[kind], (kind, outcome)
    url = workers.decode.url

    def idle() -> bool:
        full_whole = (scrape_metric(url, "decode_worker_kv_pages_used", 'pool="full"')
                      == scrape_metric(url, "decode_worker_kv_pages_evictable", 'pool="full"'))
        swa_whole = (scrape_metric(url, "decode_worker_kv_pages_used", 'pool="swa"')
                     == scrape_metric(url, "decode_worker_kv_pages_evictable", 'pool="swa"'))
        return full_whole and swa_whole and scrape_metric(
            url, "decode_worker_queue_requests") == 0

    wait_for(idle, timeout=20, what="idle worker with every page free or cached")
    time.sleep(0.5)  # at least two integrity checks on the idle worker
    http_json(f"{url}/health")  # the engine is alive: no check failed
    assert scrape_metric(url, "decode_worker_aborts_total", 'reason="client_abort"') >= 6
    assert scrape_metric(url, "decode_worker_prefix_cache_hit_tokens_total") > 0
