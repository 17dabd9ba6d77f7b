"""The real decode worker's router/operator endpoints: GET /get_load reports running and waiting
requests and their tokens (and zero when idle), /flush_cache empties the decode radix cache
after a multi-turn conversation (the next identical turn reuses nothing and decodes the same
tokens), refuses while a long request runs, waits with `?timeout=`, and the worker keeps
serving throughout. The reference prefill peer answers the same info and serves /metrics.
One server of each per module."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decode_worker.daemon.shared.procs import ServerProcess
from decode_worker.io.api.admin import FLUSHED_TEXT
from tests.e2e.live_fixtures import Live, gen_body, pool_is_whole, raw_stream

pytestmark = pytest.mark.slow
SYSTEM = [3 + (i * 13) % 250 for i in range(300)]  # longer than window + page: turns reuse it
LONG_NEW = 3900  # never finishes within a test (the client leaves); fits the 4096 context
HITS = "decode_worker_prefix_cache_hit_tokens_total"
REFUSED_LOG = "cache not flushed: 1 running"


@pytest.fixture(scope="module")
def admin(plain_live: Live) -> Live:
    return plain_live


def load(live: Live) -> dict[str, Any]:
    resp = live.get("/get_load")
    assert resp.status_code == 200, resp.text
    (rank,) = resp.json()
    return dict(rank)


def wait_load(live: Live, what: str, pred: Any, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = load(live)
        if pred(got):
            return got
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s}s: {got}"
        time.sleep(0.05)


def idle(got: dict[str, Any]) -> bool:
    return bool(got["num_reqs"] == got["num_waiting_reqs"] == got["num_tokens"] == 0)


def generate(live: Live, ids: list[int], max_new: int) -> dict[str, Any]:
    resp = live.post("/generate", gen_body(ids, max_new))
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_get_load_counts_a_running_request_and_returns_to_zero(admin: Live) -> None:
    admin.wait_idle()
    got = wait_load(admin, "idle load", idle)
    assert set(got) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}
    assert got["dp_rank"] == 0
    sock = raw_stream(admin.port, "/generate", gen_body(SYSTEM[:100], LONG_NEW, stream=True),
                      events=3)
    try:
        busy = wait_load(admin, "one running request", lambda g: g["num_reqs"] == 1)
        assert busy["num_waiting_reqs"] == 0
        assert busy["num_tokens"] >= 100  # its prompt and output pages
        assert busy["ts_tic"] > got["ts_tic"]
    finally:
        sock.close()  # the client leaves: the request is aborted
    wait_load(admin, "idle load after the client left", idle)


def test_flush_after_a_conversation_empties_the_cache_and_the_worker_keeps_serving(
        admin: Live) -> None:
    first = generate(admin, SYSTEM, 8)
    turn2 = SYSTEM + first["output_ids"] + [7, 8, 9, 10, 11, 12]
    second = generate(admin, turn2, 8)
    assert second["meta_info"]["cached_tokens"] > 0  # the conversation reused its prefix
    m = admin.wait_idle()
    assert m.pool("full")["evictable"] > 0

    resp = admin.post("/flush_cache")
    assert resp.status_code == 200 and resp.text == FLUSHED_TEXT
    m = admin.metrics()
    for pool in ("full", "swa"):
        p = m.pool(pool)
        assert p["evictable"] == 0 and p["available"] == p["total"], (pool, p)
    assert not pool_is_whole(m)
    hits = m.value(HITS)

    again = generate(admin, turn2, 8)  # the identical turn now finds nothing cached
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == second["output_ids"]  # and decodes the same tokens
    assert admin.metrics().value(HITS) == hits
    assert admin.get("/flush_cache").status_code == 200  # GET flushes too (as SGLang)
    assert admin.get("/health").status_code == 200


def test_flush_is_refused_while_a_long_request_runs(admin: Live) -> None:
    generate(admin, SYSTEM[:120], 4)  # something cached that the refusal must leave alone
    evictable = admin.wait_idle().pool("full")["evictable"]
    assert evictable > 0
    sock = raw_stream(admin.port, "/generate", gen_body(SYSTEM[150:], LONG_NEW, stream=True),
                      events=3)
    try:
        wait_load(admin, "one running request", lambda g: g["num_reqs"] == 1)
        resp = admin.post("/flush_cache")
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["reason"] == "not_idle" and "1 running" in err["message"]
        assert admin.metrics().pool("full")["evictable"] >= evictable  # nothing was evicted
        assert admin.get("/health").status_code == 200
    finally:
        sock.close()
    wait_load(admin, "idle load after the client left", idle)
    assert admin.post("/flush_cache").status_code == 200
    assert generate(admin, SYSTEM[:50], 3)["meta_info"]["cached_tokens"] == 0


def test_flush_with_timeout_waits_for_the_running_request_to_end(admin: Live) -> None:
    admin.wait_idle()
    refusals = admin.proc.output().count(REFUSED_LOG)
    answers: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answers.append(
        admin.post("/generate", gen_body(SYSTEM[:60], 300), timeout_s=60)))
    worker.start()
    try:
        wait_load(admin, "one running request", lambda g: g["num_reqs"] == 1)
        resp = admin.post("/flush_cache?timeout=60", timeout_s=90)
    finally:
        worker.join(90)
    assert resp.status_code == 200 and resp.text == FLUSHED_TEXT
    assert answers and answers[0].status_code == 200  # the request ran to its end meanwhile
    assert len(answers[0].json()["output_ids"]) == 300
    assert admin.proc.output().count(REFUSED_LOG) > refusals  # it was refused, then retried
    assert admin.metrics().pool("full")["evictable"] == 0


@pytest.fixture(scope="module")
def prefill(e2e_model_dir: Path) -> Iterator[Live]:
    """The reference prefill peer alone: a room nobody asks for times out after 1 s."""
    proc = ServerProcess("prefill-admin", [
        "prefill", "--model", str(e2e_model_dir), "--port", "0", "--bootstrap-port", "0",
        "--set", "scheduler.kv_timeout_s=1"])
    with proc:
        proc.wait_ready(120)
        live = Live(proc)
        try:
            yield live
        finally:
            live.close()


def test_prefill_peer_reports_the_same_model_name_and_no_radix_cache(
        prefill: Live, admin: Live, e2e_model_dir: Path) -> None:
    info = prefill.get("/server_info").json()
    assert info["served_model_name"] == str(e2e_model_dir) == admin.get(
        "/server_info").json()["served_model_name"]
    assert info["context_length"] == 4096 and info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_decode_enable_radix_cache"] is False
    assert info["enable_unified_radix_tree"] is False
    assert prefill.get("/model_info").json()["served_model_name"] == str(e2e_model_dir)
    assert prefill.get("/v1/models").json()["data"][0]["id"] == str(e2e_model_dir)


def test_prefill_peer_checks_context_and_model_like_the_decode_worker(prefill: Live) -> None:
    body = {**gen_body([5] * 100, 4000), "bootstrap_host": "127.0.0.1", "bootstrap_room": 7}
    resp = prefill.post("/generate", body)
    assert resp.status_code == 400 and "4096" in resp.json()["error"]["message"], resp.text
    comp = {"prompt": [5, 6], "max_tokens": 2, "model": "whatever", "bootstrap_room": 8}
    assert prefill.post("/v1/completions", comp).status_code == 404


def test_prefill_peer_serves_metrics(prefill: Live) -> None:
    body = {**gen_body([5, 6, 7], 2), "bootstrap_host": "127.0.0.1", "bootstrap_room": 9}
    resp = prefill.post("/generate", body, timeout_s=30)  # no decode side asks: kv_timeout
    assert resp.status_code == 504, resp.text
    m = prefill.metrics()
    assert m.value("decode_worker_http_requests_total", endpoint="generate", code="504") == 1
    assert m.value("decode_worker_aborts_total", reason="kv_timeout") == 1
    # the door refusals of the tests before (a 400 and a 404: bad_request) count as aborted too
    assert m.value("decode_worker_requests_total", status="aborted") == 1 + m.value(
        "decode_worker_aborts_total", reason="bad_request")
    for name in ("decode_worker_time_to_first_token_seconds",  # the prefill time, from the
                 "decode_worker_request_e2e_seconds"):  # request to the KV handed off
        assert m.types.get(name) == "histogram", name
