"""Every generation request refused before the backend started it goes to `backend.refuse` once,
with its abort label and the rooms its body names (so the decode worker ends the prefill peer's
copy at once); the error body names the same reason."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from decode_worker.errors import QueueFull
from decode_worker.io.api import ApiApp, ApiConfig, Health
from decode_worker.io.api.targets import Target, body_targets
from decode_worker.io.metrics import Metrics
from tests.fakes.fake_backend import FakeBackend, ServerThread

BOOT = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 77}


@pytest.fixture
def served() -> Iterator[tuple[httpx.Client, FakeBackend]]:
    backend = FakeBackend()
    app = ApiApp(backend, ApiConfig(max_prompt_tokens=8, api_key="k"), Metrics())
    headers = {"authorization": "Bearer k"}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5,
                                                headers=headers) as c:
        yield c, backend


def test_a_prompt_over_max_prompt_tokens_is_413_too_large_and_refused_at_its_room(
        served: tuple[httpx.Client, FakeBackend]) -> None:
    client, backend = served
    r = client.post("/generate", json={"input_ids": [5] * 9, **BOOT})
    assert r.status_code == 413 and r.json()["error"]["reason"] == "too_large"
    [(targets, reason, message)] = backend.refused
    assert targets == [Target("10.0.0.1", 8998, 77)] and reason == "too_large"
    assert "at most 8" in message


@pytest.mark.parametrize("body, status, label", [
    ({"input_ids": [5], "sampling_params": {"temperature": -1}}, 400, "bad_request"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 5000}}, 400, "bad_request"),
])
def test_400s_are_refused_as_bad_request(served: tuple[httpx.Client, FakeBackend],
                                         body: dict[str, object], status: int,
                                         label: str) -> None:
    client, backend = served
    r = client.post("/generate", json={**body, **BOOT})
    assert r.status_code == status, r.text
    assert [(t, lab) for t, lab, _ in backend.refused] == [([Target("10.0.0.1", 8998, 77)],
                                                            label)]


def test_a_model_404_and_a_chat_refusal_name_their_rooms(
        served: tuple[httpx.Client, FakeBackend]) -> None:
    client, backend = served
    r = client.post("/v1/chat/completions", json={
        "model": "other", "messages": [{"role": "user", "content": "hi"}], **BOOT})
    assert r.status_code == 404 and r.json()["error"]["reason"] == "model_not_found"
    assert [(t, lab) for t, lab, _ in backend.refused] == [([Target("10.0.0.1", 8998, 77)],
                                                            "bad_request")]


def test_queue_full_and_draining_are_503s_with_their_reasons(
        served: tuple[httpx.Client, FakeBackend]) -> None:
    client, backend = served
    backend.start_error = QueueFull("queue full (1 requests waiting to start): retry later")
    r = client.post("/generate", json={"input_ids": [5], **BOOT})
    assert r.status_code == 503 and r.json()["error"]["reason"] == "queue_full"
    assert r.headers["retry-after"]
    backend.start_error = None
    backend.health_state = Health("draining", "draining: not accepting new requests")
    r = client.post("/v1/completions", json={"prompt": [5], **BOOT})
    assert r.status_code == 503 and r.json()["error"]["reason"] == "drain"
    assert [lab for _, lab, _ in backend.refused] == ["queue_full", "drain"]


def test_unauthenticated_and_non_generation_errors_refuse_nothing(
        served: tuple[httpx.Client, FakeBackend]) -> None:
    client, backend = served
    r = client.post("/generate", json={"input_ids": [5], **BOOT},
                    headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert client.get("/nope").status_code == 404
    assert backend.refused == []


def test_a_request_without_rooms_is_still_counted_once(
        served: tuple[httpx.Client, FakeBackend]) -> None:
    client, backend = served
    assert client.post("/generate", content=b"not json").status_code == 400
    assert [(t, lab) for t, lab, _ in backend.refused] == [([Target()], "bad_request")]


def test_body_targets_follow_the_sample_rules() -> None:
    def targets(body: str) -> list[Target]:
        return body_targets(body.encode())

    assert targets('{"bootstrap_host": "h", "bootstrap_room": 5, "sampling_params": '
                   '{"n": 3}, "input_ids": [1]}') == [Target("h", None, r) for r in (5, 6, 7)]
    assert targets('{"bootstrap_host": ["a", "b"], "bootstrap_port": [1, 2], '
                   '"bootstrap_room": [8, 9], "text": ["x", "y"]}') == [
        Target("a", 1, 8), Target("b", 2, 9)]
    # lengths that do not add up still name every room they hold
    assert targets('{"bootstrap_host": "h", "bootstrap_port": 3, "bootstrap_room": [1, 2, 4], '
                   '"n": 2}') == [Target("h", 3, 1), Target("h", 3, 2), Target("h", 3, 4)]
    for nothing in ('{"bootstrap_room": 5}', '[1]', 'nope', '{"bootstrap_host": "h", '
                    '"bootstrap_room": "x"}', '{"bootstrap_host": "h", "bootstrap_room": -1}'):
        assert targets(nothing) == [], nothing
