"""GET /get_load and /flush_cache over HTTP against a FakeBackend: SGLang's shapes, methods,
statuses, auth, the `timeout` retry, and the per-endpoint HTTP metric."""

from __future__ import annotations

import httpx
import pytest

from decode_worker.errors import ClientError
from decode_worker.io.api import ApiApp, ApiConfig, FlushResult, Load
from decode_worker.io.api.admin import FLUSHED_TEXT, flush_timeout_s
from decode_worker.io.metrics import Metrics
from tests.fakes.fake_backend import FakeBackend, ServerThread

BUSY = FlushResult(False, "cache not flushed: 1 running and 2 waiting requests")


def test_get_load_is_a_list_of_one_dp_rank_as_sglang_answers() -> None:
    backend = FakeBackend(load_state=Load(num_running_reqs=3, num_waiting_reqs=2,
                                          num_tokens=1234, measured_at=5.5))
    with ServerThread(ApiApp(backend, ApiConfig())) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.get("/get_load")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2,
                             "num_tokens": 1234, "ts_tic": 5.5}]
        assert c.head("/get_load").status_code == 200
        r = c.post("/get_load")
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"


def test_flush_cache_answers_sglang_text_on_get_and_post() -> None:
    backend = FakeBackend()
    with ServerThread(ApiApp(backend, ApiConfig())) as srv, httpx.Client(base_url=srv.url) as c:
        for method in ("GET", "POST"):
            r = c.request(method, "/flush_cache")
            assert r.status_code == 200 and r.text == FLUSHED_TEXT
            assert r.headers["content-type"].startswith("text/plain")
        for method in ("PUT", "HEAD"):  # HEAD would flush: not offered on a GET|POST route
            r = c.request(method, "/flush_cache")
            assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    assert backend.flushes == 2


def test_flush_cache_refused_while_busy_is_a_400_json_error() -> None:
    backend = FakeBackend(flush_results=[BUSY])
    with ServerThread(ApiApp(backend, ApiConfig())) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post("/flush_cache")
    assert r.status_code == 400
    assert r.json() == {"error": {"message": BUSY.message, "type": "invalid_request_error",
                                  "code": 400, "reason": "not_idle"}}
    assert backend.flushes == 1


def test_flush_cache_with_timeout_retries_until_the_worker_is_idle() -> None:
    backend = FakeBackend(flush_results=[BUSY, BUSY, FlushResult(True)])
    with ServerThread(ApiApp(backend, ApiConfig())) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.post("/flush_cache?timeout=5")
        assert r.status_code == 200 and r.text == FLUSHED_TEXT
        assert backend.flushes == 3
        backend.flush_results = [BUSY]
        r = c.post("/flush_cache?timeout=0.2")  # still busy when the timeout runs out
        assert r.status_code == 400 and r.json()["error"]["reason"] == "not_idle"
        assert backend.flushes > 4  # it asked again meanwhile
        r = c.post("/flush_cache?timeout=soon")
        assert r.status_code == 400 and "timeout" in r.json()["error"]["message"]


@pytest.mark.parametrize("query, want", [("", 0.0), ("timeout=2.5", 2.5), ("x=1&timeout=0", 0.0)])
def test_flush_timeout_parses_seconds(query: str, want: float) -> None:
    assert flush_timeout_s(query) == want


@pytest.mark.parametrize("query", ["timeout=-1", "timeout=nan", "timeout=inf", "timeout=abc",
                                   "timeout=3601"])
def test_flush_timeout_rejects_what_is_not_a_sane_number_of_seconds(query: str) -> None:
    with pytest.raises(ClientError):
        flush_timeout_s(query)


def test_flush_cache_needs_the_api_key_and_get_load_stays_open() -> None:
    backend = FakeBackend()
    app = ApiApp(backend, ApiConfig(api_key="sekret"))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url) as c:
        assert c.post("/flush_cache").status_code == 401
        assert c.get("/flush_cache").status_code == 401
        assert backend.flushes == 0
        ok = c.post("/flush_cache", headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200 and backend.flushes == 1
        assert c.get("/get_load").status_code == 200  # the router polls it without a key


def test_flush_and_load_are_counted_per_endpoint_in_http_requests_total() -> None:
    metrics = Metrics()
    backend = FakeBackend(flush_results=[FlushResult(True), BUSY])
    with ServerThread(ApiApp(backend, ApiConfig(), metrics)) as srv, \
            httpx.Client(base_url=srv.url) as c:
        c.post("/flush_cache")
        c.post("/flush_cache")
        c.get("/get_load")
    lines = metrics.exposition()[0].decode().splitlines()
    for code, endpoint in (("200", "flush_cache"), ("400", "flush_cache"), ("200", "get_load")):
        want = f'decode_worker_http_requests_total{{code="{code}",endpoint="{endpoint}"}} 1.0'
        assert want in lines
