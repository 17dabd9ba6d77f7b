"""Fuzzing the HTTP API: random and mutated bodies posted to every route of the real server
(`ApiApp` behind `HttpServer`, the scripted FakeBackend behind it). Every answer is a 2xx or a
4xx whose JSON body says what was wrong; never a 5xx, never an exception logged by a handler,
and the server still answers /health afterwards."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.io.metrics import Metrics
from tests.examples import examples
from tests.fakes.fake_backend import FakeBackend, ServerThread

SAMPLING = {"max_new_tokens": 3, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.0,
            "seed": 1, "stop": ["x"], "stop_token_ids": [7], "ignore_eos": False, "n": 1}
VALID: dict[str, dict[str, Any]] = {
    "/generate": {"text": "hi", "input_ids": None, "sampling_params": SAMPLING, "stream": False,
                  "rid": "r", "return_logprob": True, "top_logprobs_num": 2,
                  "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0.0,
                        "stop": "x", "n": 1, "stream": False, "logprobs": 1, "echo": False,
                        "stream_options": {"include_usage": True}, "seed": 3},
    "/v1/chat/completions": {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "stream": False,
        "stop_token_ids": [1], "top_p": 1.0},
}
POST_ROUTES = (*VALID, "/flush_cache")
GET_ROUTES = ("/health", "/health_generate", "/server_info", "/get_server_info", "/model_info",
              "/get_model_info", "/v1/models", "/metrics", "/get_load", "/flush_cache")

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                               max_size=4),
    max_leaves=10)
# values near the edges the handlers check: sizes, counts, ids, probabilities
edge_value: st.SearchStrategy[Any] = st.sampled_from([
    0, -1, 1, 2**31, 2**63, -(2**63), 10**9, 0.0, -0.5, 1.5, 1e308, "", "m", "other-model", [],
    [[]], [-1], [2**40], {}, None, True, ["a"] * 50, "\x00", "\ud7ff" * 3])


class ErrorLog(logging.Handler):
    """Collects ERROR records from the daemon's loggers (an exception a handler let escape)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[httpx.Client, ErrorLog]]:
    errors = ErrorLog()
    logging.getLogger("decode_worker").addHandler(errors)
    app = ApiApp(FakeBackend(), ApiConfig(max_prompt_tokens=64, default_max_new_tokens=5),
                 Metrics())
    try:
        with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
            yield c, errors
    finally:
        logging.getLogger("decode_worker").removeHandler(errors)


def check_answer(client: httpx.Client, errors: ErrorLog, method: str, path: str,
                 content: bytes, query: str = "") -> None:
    r = client.request(method, path + query, content=content,
                       headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, content[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["message"], r.text[:300]
    assert not errors.records, [rec.getMessage() for rec in errors.records]


def mutate(body: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """Replace, drop or add one field, at the top level or one level down."""
    out: dict[str, Any] = json.loads(json.dumps(body))
    target = out
    nested = [k for k, v in out.items() if isinstance(v, dict)]
    go_down: bool = data.draw(st.booleans())
    if nested and go_down:
        target = out[data.draw(st.sampled_from(nested))]
    op = data.draw(st.sampled_from(["replace", "edge", "drop", "add"]))
    if not target:
        op = "add"
    key = data.draw(st.sampled_from(sorted(target))) if target else ""
    if op == "replace":
        target[key] = data.draw(json_value)
    elif op == "edge":
        target[key] = data.draw(edge_value)
    elif op == "drop":
        del target[key]
    else:
        target[data.draw(st.text(min_size=1, max_size=10))] = data.draw(json_value)
    return out


FUZZ = settings(max_examples=examples(150), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_mutated_valid_bodies_get_an_answer_or_a_clear_4xx(
        server: tuple[httpx.Client, ErrorLog], data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(VALID)))
    body = VALID[path]
    for _ in range(data.draw(st.integers(1, 3))):
        body = mutate(body, data)
    check_answer(*server, "POST", path, json.dumps(body).encode())


@FUZZ
@given(path=st.sampled_from(POST_ROUTES), body=json_value)
def test_random_json_bodies_get_a_clear_4xx(server: tuple[httpx.Client, ErrorLog], path: str,
                                            body: Any) -> None:
    check_answer(*server, "POST", path, json.dumps(body).encode())


@FUZZ
@given(path=st.sampled_from(POST_ROUTES), raw=st.binary(max_size=300), cut=st.integers(0, 400))
def test_random_bytes_and_truncated_json_get_a_clear_4xx(
        server: tuple[httpx.Client, ErrorLog], path: str, raw: bytes, cut: int) -> None:
    check_answer(*server, "POST", path, raw)
    if path in VALID:
        check_answer(*server, "POST", path, json.dumps(VALID[path]).encode()[:cut])


@FUZZ
@given(path=st.sampled_from(GET_ROUTES), query=st.text(max_size=30))
def test_random_query_strings_on_get_routes(server: tuple[httpx.Client, ErrorLog], path: str,
                                            query: str) -> None:
    from urllib.parse import quote

    check_answer(*server, "GET", path, b"", "?" + quote(query, safe="=&"))


def test_server_still_serves_after_the_fuzzing(server: tuple[httpx.Client, ErrorLog]) -> None:
    client, errors = server
    assert client.get("/health").status_code == 200
    r = client.post("/generate", json=VALID["/generate"])
    assert r.status_code == 200 and r.json()["output_ids"], r.text
    assert not errors.records
