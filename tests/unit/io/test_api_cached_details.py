"""The device/host split of `cached_tokens` as SGLang reports it: `meta_info.cached_tokens_details`
on /generate (streamed and not), and `sglext.cached_tokens_details` on the OpenAI routes only
when `return_cached_tokens_details` asks for it (`prompt_tokens_details` keeps OpenAI's shape)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.io.api.common import cached_tokens_details
from tests.fakes.fake_backend import FakeBackend, ServerThread
from tests.unit.io.test_api_generate import sse_events


@pytest.mark.parametrize(("cached", "host", "details"), [
    (0, 0, None),  # nothing cached: null, as SGLang
    (48, 0, {"device": 48, "host": 0}),  # no host hit (or no host tier)
    (48, 32, {"device": 16, "host": 32}),
    (32, 32, {"device": 0, "host": 32}),  # every cached token came from the host tier
    (16, 32, {"device": 0, "host": 16}),  # never more host than cached
])
def test_cached_tokens_details_splits_device_and_host(
        cached: int, host: int, details: dict[str, int] | None) -> None:
    assert cached_tokens_details(cached, host) == details


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(cached_tokens=5, host_cached_tokens=3)


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[httpx.Client]:
    app = ApiApp(backend, ApiConfig(served_model_name="tiny", default_max_new_tokens=5))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c:
        yield c


def test_generate_reports_the_split_beside_cached_tokens(client: httpx.Client) -> None:
    meta = client.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 3}}).json()["meta_info"]
    assert meta["cached_tokens"] == 5
    assert meta["cached_tokens_details"] == {"device": 2, "host": 3}


def test_generate_stream_reports_the_split_on_every_event(client: httpx.Client) -> None:
    r = client.post("/generate", json={"text": "hi", "stream": True,
                                       "sampling_params": {"max_new_tokens": 3}})
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    assert len(events) == 3
    for event in events:
        meta: dict[str, Any] = event["meta_info"]  # type: ignore[index]
        assert meta["cached_tokens_details"] == {"device": 2, "host": 3}


def test_generate_without_cached_tokens_reports_null(client: httpx.Client,
                                                     backend: FakeBackend) -> None:
    backend.cached_tokens = backend.host_cached_tokens = 0
    meta = client.post("/generate", json={"text": "hi"}).json()["meta_info"]
    assert "cached_tokens_details" in meta and meta["cached_tokens_details"] is None


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_add_sglext_only_when_asked(client: httpx.Client, route: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    body.update({"prompt": "ab"} if "chat" not in route else {
        "messages": [{"role": "user", "content": "ab"}]})
    plain = client.post(route, json=body).json()
    assert "sglext" not in plain
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    asked = client.post(route, json={**body, "return_cached_tokens_details": True}).json()
    assert asked["sglext"] == {"cached_tokens_details": {"device": 2, "host": 3}}
    assert asked["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


def test_openai_stream_sends_one_sglext_chunk_before_usage(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 2,
        "stream": True, "stream_options": {"include_usage": True},
        "return_cached_tokens_details": True})
    events = sse_events(r.text)
    ext = [e for e in events if isinstance(e, dict) and "sglext" in e]
    assert len(ext) == 1 and ext[0]["choices"] == []
    assert ext[0]["sglext"] == {"cached_tokens_details": {"device": 2, "host": 3}}
    assert events.index(ext[0]) == len(events) - 3  # then usage, then [DONE]
    usage = events[-2]["usage"]  # type: ignore[index]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 5}
