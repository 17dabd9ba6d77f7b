"""POST /generate and the small endpoints, over HTTP with the scripted FakeBackend."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from decode_worker.io.api import ApiApp, ApiConfig, Health
from decode_worker.io.metrics import Metrics
from tests.fakes.fake_backend import EOS, FakeBackend, ServerThread


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[httpx.Client]:
    app = ApiApp(backend, ApiConfig(max_prompt_tokens=64, default_max_new_tokens=5), Metrics())
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c:
        yield c


def sse_events(text: str) -> list[object]:
    out: list[object] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_text_returns_sglang_shape(client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 5}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "Hello"
    assert body["output_ids"] == list(b"Hello")
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 2 and meta["completion_tokens"] == 5
    assert meta["cached_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert backend.inputs[0].input_ids == list(b"hi")


def test_generate_input_ids_and_router_fields(client: httpx.Client, backend: FakeBackend) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "rid": "r1", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
            "bootstrap_room": 7196325092418873702, "model": None, "log_metrics": True,
            "return_text_in_logprobs": False, "background": False}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    inp = backend.inputs[0]
    assert (inp.bootstrap_host, inp.bootstrap_port, inp.bootstrap_room) == (
        "10.0.0.1", 8998, 7196325092418873702)
    assert inp.rid == "r1" and inp.sampling.is_greedy and inp.sampling.max_new_tokens == 2
    assert r.json()["meta_info"]["id"] == "r1"


def test_generate_logprob_triples(client: httpx.Client) -> None:
    r = client.post("/generate", json={"text": "a", "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 2}})
    assert r.json()["meta_info"]["output_token_logprobs"] == [[-0.5, 72, None], [-0.5, 101, None]]


def test_generate_stop_token_is_trimmed_from_text(client: httpx.Client,
                                                  backend: FakeBackend) -> None:
    backend.eos_at_end = True
    r = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 50}})
    body = r.json()
    assert body["text"] == "Hello, world!" and body["output_ids"][-1] == EOS
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


def test_generate_stop_string_ends_and_tells_backend(client: httpx.Client,
                                                     backend: FakeBackend) -> None:
    r = client.post("/generate", json={"text": "a", "sampling_params": {
        "max_new_tokens": 50, "stop": ", w"}})
    body = r.json()
    assert body["text"] == "Hello"
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": ", w"}
    assert backend.finished == [backend.inputs[0].rid] and backend.aborts == []


def test_generate_stream_is_cumulative_and_ends_with_done(client: httpx.Client) -> None:
    r = client.post("/generate", json={"text": "a", "stream": True,
                                       "sampling_params": {"max_new_tokens": 3}})
    assert r.headers["content-type"] == "text/event-stream"
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]  # type: ignore[index]
    assert texts == ["H", "He", "Hel"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"  # type: ignore[index]


def test_stream_never_splits_a_utf8_character(client: httpx.Client, backend: FakeBackend) -> None:
    backend.reply = "é€".encode()  # 2 + 3 bytes, one token per byte
    r = client.post("/generate", json={"text": "a", "stream": True,
                                       "sampling_params": {"max_new_tokens": 5}})
    texts = [e["text"] for e in sse_events(r.text)[:-1]]  # type: ignore[index]
    assert texts == ["", "é", "é", "é", "é€"]  # one event per token; text only grows whole


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "malformed JSON"),
    (b"", 400, "empty"),
    (b"[1, 2]", 400, "Expected `object`"),
    (b'{"text": []}', 400, "batch is empty"),
    (b'{"input_ids": [[1], 2]}', 400, "list of such lists"),
    (b'{"text": ["a", "b"], "bootstrap_room": [1, 2, 3]}', 400, "3 entries for 2 samples"),
    (b'{"text": ["a", "b"], "bootstrap_room": 18446744073709551615}', 400, "bootstrap_room"),
    (b'{"text": "a", "sampling_params": {"temperature": "hot"}}', 400, "temperature"),
    (b'{"text": "a", "sampling_params": {"top_p": 0}}', 400, "top_p"),
    (b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', 400, "max_new_tokens"),
    (b'{"text": "a", "sampling_params": {"n": 0}}', 400, "n=0"),
    (b'{"text": "a", "sampling_params": {"n": 1000}}', 400, "at most 128"),
    (b'{"text": "a", "input_ids": [1]}', 400, "exactly one"),
    (b'{"sampling_params": {}}', 400, "exactly one"),
    (b'{"input_ids": []}', 400, "empty"),
    (b'{"input_ids": [1, -4]}', 400, "non-negative"),
    (b'{"text": "a", "bootstrap_room": -1}', 400, "bootstrap_room"),
    (b'{"input_ids": [' + b",".join([b"1"] * 65) + b"]}", 413, "at most 64"),
])
def test_bad_generate_requests_get_4xx_with_a_message(
    client: httpx.Client, backend: FakeBackend, body: bytes, status: int, needle: str
) -> None:
    r = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status
    assert backend.inputs == []


def test_unknown_route_and_wrong_method(client: httpx.Client) -> None:
    assert client.get("/nope").status_code == 404
    r = client.get("/generate")
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_draining_answers_503_with_retry_after(client: httpx.Client,
                                               backend: FakeBackend) -> None:
    backend.health_state = Health("draining", "draining: SIGTERM", retry_after_s=7)
    for path in ("/health", "/generate"):
        r = client.request("GET" if path == "/health" else "POST", path, json={"text": "a"})
        assert r.status_code == 503 and r.headers["retry-after"] == "7", path
    assert backend.inputs == []


def test_backend_rejection_before_first_chunk_is_a_plain_http_error(
    client: httpx.Client, backend: FakeBackend
) -> None:
    from decode_worker.errors import RequestTooLarge, ServiceUnavailable

    backend.start_error = RequestTooLarge("prompt + max_new_tokens exceed the context")
    r = client.post("/generate", json={"text": "a", "stream": True})
    assert r.status_code == 413 and "context" in r.json()["error"]["message"]
    backend.start_error = ServiceUnavailable("queue full")
    assert client.post("/generate", json={"text": "a"}).status_code == 503


def test_error_mid_stream_is_an_sse_error_event(client: httpx.Client,
                                                backend: FakeBackend) -> None:
    backend.error_after = 2
    r = client.post("/generate", json={"text": "a", "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "scripted failure"  # type: ignore[index]
    assert len(events) == 4


def test_error_in_non_streaming_request_uses_its_status(client: httpx.Client,
                                                        backend: FakeBackend) -> None:
    backend.error_after = 0
    r = client.post("/generate", json={"text": "a"})
    assert r.status_code == 500 and r.json()["error"]["reason"] == "transfer_failed"


def test_health_and_info_endpoints(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    for path in ("/server_info", "/get_server_info"):
        assert client.get(path).json()["disaggregation_mode"] == "decode"
    for path in ("/model_info", "/get_model_info"):
        assert client.get(path).json()["is_generation"] is True
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "/nonexistent"


def test_duplicate_live_rid_gets_a_unique_internal_rid(backend: FakeBackend) -> None:
    backend.delay_s = 0.05
    app = ApiApp(backend, ApiConfig())
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c1, \
            httpx.Client(base_url=srv.url, timeout=5) as c2:
        body = {"text": "a", "rid": "same", "stream": True,
                "sampling_params": {"max_new_tokens": 3}}
        with c1.stream("POST", "/generate", json=body) as r1:
            chunks = r1.iter_bytes()
            next(chunks)
            r2 = c2.post("/generate", json=body)
            assert r2.status_code == 200
            assert b"[DONE]" in b"".join(chunks)
    rids = [inp.rid for inp in backend.inputs]
    assert rids[0] == "same" and rids[1].startswith("same-") and len(set(rids)) == 2


def test_generate_top_logprobs_per_token(client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/generate", json={"text": "a", "return_logprob": True, "top_logprobs_num": 2,
                                       "sampling_params": {"max_new_tokens": 2}})
    meta = r.json()["meta_info"]
    assert meta["output_top_logprobs"] == [[[-0.5, 72, None], [-1.5, 73, None]],
                                           [[-0.5, 101, None], [-1.5, 102, None]]]
    assert backend.inputs[-1].top_logprobs == 2
    # without return_logprob the alternatives are not asked for (as SGLang)
    r = client.post("/generate", json={"text": "a", "top_logprobs_num": 2})
    assert "output_top_logprobs" not in r.json()["meta_info"]
    assert backend.inputs[-1].top_logprobs == 0
    bad = client.post("/generate", json={"text": "a", "return_logprob": True,
                                         "top_logprobs_num": 21})
    assert bad.status_code == 400 and "top_logprobs_num" in bad.text
