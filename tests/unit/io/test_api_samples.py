"""n > 1 and batches of prompts, as sglang-router sends them (one bootstrap room per sample)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.io.metrics import Metrics
from tests.fakes.fake_backend import FakeBackend, ServerThread
from tests.waiting import wait_for

ROUTER_FIELDS = {"bootstrap_host": ["10.0.0.1", "10.0.0.1"], "bootstrap_port": [8998, 8998],
                 "bootstrap_room": [11, 22]}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[httpx.Client]:
    app = ApiApp(backend, ApiConfig(max_prompt_tokens=64, default_max_new_tokens=5), Metrics())
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c:
        yield c


def sse_objects(text: str) -> list[dict[str, object]]:
    return [json.loads(b[6:]) for b in text.split("\n\n")
            if b.startswith("data: ") and b[6:] != "[DONE]"]


def test_generate_text_batch_is_a_list_with_one_room_per_prompt(
        client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/generate", json={"text": ["ab", "cde"], "rid": "b",
                                       "sampling_params": {"max_new_tokens": 3}, **ROUTER_FIELDS})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["text"] for o in out] == ["Hel", "Hel"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]
    assert [(i.input_ids, i.bootstrap_room, i.rid) for i in backend.inputs] == [
        (list(b"ab"), 11, "b-0"), (list(b"cde"), 22, "b-1")]


def test_generate_n2_gives_each_sample_its_own_seed_and_room(
        client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/generate", json={
        "input_ids": [5, 6], "sampling_params": {"n": 2, "seed": 40, "max_new_tokens": 2},
        **ROUTER_FIELDS})
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2
    assert [(i.sampling.seed, i.bootstrap_room) for i in backend.inputs] == [(40, 11), (41, 22)]


def test_one_room_for_many_samples_gives_consecutive_rooms_as_sglang_does(
        client: httpx.Client, backend: FakeBackend) -> None:
    """sglang-router 0.3.2 sends one room for chat n=2; SGLang then uses room + k."""
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "n": 3, "max_tokens": 2, "bootstrap_host": "h", "bootstrap_port": 9,
        "bootstrap_room": 100})
    assert r.status_code == 200, r.text
    assert [(i.bootstrap_host, i.bootstrap_port, i.bootstrap_room) for i in backend.inputs] == [
        ("h", 9, 100), ("h", 9, 101), ("h", 9, 102)]


def test_one_room_per_prompt_with_n2_gives_each_sample_its_own_room(
        client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/v1/completions", json={
        "prompt": ["a", "b"], "n": 2, "max_tokens": 2, "bootstrap_host": ["h", "h"],
        "bootstrap_port": [9, 9], "bootstrap_room": [100, 200]})
    assert r.status_code == 200, r.text
    assert [i.bootstrap_room for i in backend.inputs] == [100, 101, 200, 201]


def test_generate_token_id_prompt_with_router_arrays_uses_the_first_room(
        client: httpx.Client, backend: FakeBackend) -> None:
    """The router reads a token-id list as a batch of that many prompts (one room each)."""
    r = client.post("/v1/completions", json={
        "prompt": [5, 6], "max_tokens": 2, **ROUTER_FIELDS})
    assert r.status_code == 200, r.text
    assert [i.bootstrap_room for i in backend.inputs] == [11]
    assert len(r.json()["choices"]) == 1


def test_generate_batch_stream_events_name_their_index(client: httpx.Client) -> None:
    r = client.post("/generate", json={"text": ["a", "b"], "stream": True,
                                       "sampling_params": {"max_new_tokens": 3}})
    events = sse_objects(r.text)
    assert {e["index"] for e in events} == {0, 1}
    last = {e["index"]: e for e in events}
    assert all(e["meta_info"]["finish_reason"] == {"type": "length", "length": 3}  # type: ignore[index]
               for e in last.values())


def test_chat_n2_has_two_choices_and_counts_the_prompt_once(
        client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "max_tokens": 4,
                                                  **ROUTER_FIELDS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["content"] == "Hell" for c in body["choices"])
    prompt = len(backend.inputs[0].input_ids)
    assert body["usage"]["prompt_tokens"] == prompt
    assert body["usage"]["completion_tokens"] == 8


def test_chat_n2_stream_sends_role_deltas_and_finish_per_choice(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "n": 2, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = sse_objects(r.text)
    texts: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]  # type: ignore[misc]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Hel", 1: "Hel"} and finishes == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 6  # type: ignore[index]


def test_completions_prompt_batch_orders_choices_prompt_major(
        client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/v1/completions", json={"prompt": ["ab", "c"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [i.input_ids for i in backend.inputs] == [list(b"ab")] * 2 + [list(b"c")] * 2
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 8


def test_one_failing_sample_fails_the_request_and_ends_the_others(
        client: httpx.Client, backend: FakeBackend) -> None:
    backend.error_after = 2
    backend.delay_s = 0.01
    r = client.post("/v1/completions", json={"prompt": ["ab", "c"], "max_tokens": 8})
    assert r.status_code == 500, r.text
    assert "error" in r.json()
    wait_for(lambda: len(backend.closed) == 2)  # both samples' iterators were closed
