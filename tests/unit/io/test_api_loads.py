"""GET /v1/loads over HTTP against a FakeBackend: SGLang's shape as the SGLang Model Gateway
(smg 1.13) parses it (counts as integers, a string timestamp, the decode queues in the
`disaggregation` section), `include` sections, and clear 400s for what is not served."""

from __future__ import annotations

from datetime import datetime

import httpx

from decode_worker.io.api import ApiApp, ApiConfig, Load
from tests.fakes.fake_backend import FakeBackend, ServerThread

BUSY = Load(num_running_reqs=3, num_waiting_reqs=5, num_tokens=1100, measured_at=7.0,
            num_used_tokens=1000, num_queued_tokens=100, num_prealloc_reqs=2,
            num_transfer_reqs=3, cache_hit_rate=0.25)
INFO = {"max_total_num_tokens": 4000, "max_running_requests": 64}


def _get(backend: FakeBackend, path: str) -> httpx.Response:
    with ServerThread(ApiApp(backend, ApiConfig())) as srv, httpx.Client(base_url=srv.url) as c:
        return c.get(path)


def test_v1_loads_reports_one_rank_in_sglangs_shape() -> None:
    r = _get(FakeBackend(load_state=BUSY, server_extra=INFO),
             "/v1/loads?include=core,disagg,queues,memory")  # exactly what smg asks
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    datetime.fromisoformat(body["timestamp"])  # a string: smg reads it into a String
    assert body["num_accelerators"] == 1 and isinstance(body["version"], str)
    [row] = body["loads"]
    assert row["dp_rank"] == 0
    assert (row["num_running_reqs"], row["num_waiting_reqs"]) == (3, 5)
    assert (row["num_used_tokens"], row["max_total_num_tokens"]) == (1000, 4000)
    assert row["num_waiting_uncached_tokens"] == 100 and row["num_total_tokens"] == 1100
    assert row["token_usage"] == 0.25 and row["cache_hit_rate"] == 0.25
    assert row["max_running_requests"] == 64
    ints = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens",
            "max_running_requests", "num_waiting_uncached_tokens")
    assert all(type(row[k]) is int for k in ints)  # 1.0 would not parse as smg's i32
    disagg = row["disaggregation"]
    assert disagg["mode"] == "decode"
    assert (disagg["decode_prealloc_queue_reqs"], disagg["decode_transfer_queue_reqs"]) == (2, 3)
    assert set(row["queues"]) == {"waiting", "grammar", "paused", "retracted", "prealloc_ready"}
    # smg's flat names for the same (it does not read the nested section over HTTP)
    assert (row["disagg_mode"], row["decode_queue_reqs"], row["num_total_reqs"]) == (
        "decode", 5, 8)
    assert "memory" not in row  # nothing to report: left out, as SGLang leaves it out


def test_v1_loads_core_only_and_unknown_capacity() -> None:
    r = _get(FakeBackend(load_state=BUSY), "/v1/loads?include=core")
    [row] = r.json()["loads"]
    assert "disaggregation" not in row and "queues" not in row
    assert row["max_total_num_tokens"] == 0 and row["token_usage"] == 0.0


def test_v1_loads_refuses_what_it_does_not_serve_with_a_message() -> None:
    backend = FakeBackend(load_state=BUSY)
    for query, needle in (("include=core,bogus", "bogus"), ("dp_rank=1", "dp_rank"),
                          ("format=prometheus", "prometheus")):
        r = _get(backend, f"/v1/loads?{query}")
        assert r.status_code == 400, query
        assert needle in r.json()["error"]["message"]
    assert _get(backend, "/v1/loads?dp_rank=0&format=json").status_code == 200
