"""Context length and model name on every generation route, over HTTP with the FakeBackend."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from decode_worker.errors import ClientError
from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.io.api.limits import resolve_max_new_tokens
from decode_worker.io.metrics import Metrics
from tests.fakes.fake_backend import FakeBackend, ServerThread

CTX = 64
MODEL = "/models/tiny-gpt-oss"


@dataclass
class SmallContext(FakeBackend):
    """A FakeBackend whose model takes CTX tokens; `extra_info` is merged into server_info."""

    context_length: int | None = CTX
    extra_info: dict[str, Any] | None = None

    def server_info(self) -> dict[str, Any]:
        info = {**super().server_info(), "context_length": self.context_length}
        return {**info, **(self.extra_info or {})}


@pytest.fixture
def backend() -> SmallContext:
    return SmallContext(model_path=MODEL)


def serve(backend: FakeBackend, config: ApiConfig) -> Iterator[httpx.Client]:
    with ServerThread(ApiApp(backend, config, Metrics())) as srv, \
            httpx.Client(base_url=srv.url, timeout=5) as client:
        yield client


@pytest.fixture
def client(backend: SmallContext) -> Iterator[httpx.Client]:
    yield from serve(backend, ApiConfig(default_max_new_tokens=5))


def gen(ids: list[int], max_new: int | None = None) -> dict[str, Any]:
    sp = {} if max_new is None else {"max_new_tokens": max_new}
    return {"input_ids": ids, "sampling_params": sp}


def comp(ids: list[int], max_tokens: int | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": ids, **extra}
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


def chat(text: str, max_tokens: int | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], **extra}
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


CHAT_OVERHEAD = len("<user>\n<assistant>")  # the fake tokenizer's template, one token a byte


@pytest.mark.parametrize(("path", "body", "prompt"), [
    ("/generate", gen([1] * 40, 25), 40),
    ("/v1/completions", comp([1] * 40, 25), 40),
    ("/v1/chat/completions", chat("x" * 22, 25), 22 + CHAT_OVERHEAD),
])
def test_prompt_plus_max_new_tokens_past_the_context_is_400_before_queueing(
        client: httpx.Client, backend: SmallContext, path: str, body: dict[str, Any],
        prompt: int) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for number in (CTX, prompt, 25, prompt + 25):
        assert str(number) in message, message
    assert "context length" in message
    assert backend.inputs == []


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", gen([1] * CTX)), ("/v1/completions", comp([1] * (CTX + 5), 1)),
    ("/v1/chat/completions", chat("x" * CTX)),
])
def test_a_prompt_that_fills_the_context_is_400(client: httpx.Client, backend: SmallContext,
                                                path: str, body: dict[str, Any]) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert f"context length ({CTX} tokens)" in r.json()["error"]["message"]
    assert backend.inputs == []


def test_exactly_the_context_is_accepted(client: httpx.Client, backend: SmallContext) -> None:
    assert client.post("/generate", json=gen([1] * 40, CTX - 40)).status_code == 200
    assert backend.inputs[0].sampling.max_new_tokens == CTX - 40


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/generate", gen([1] * 10), CTX - 10),  # up to the context, as SGLang
    ("/v1/chat/completions", chat("x" * 10), CTX - 10 - CHAT_OVERHEAD),
    ("/v1/completions", comp([1] * 10), 16),  # OpenAI's and SGLang's default
    ("/v1/completions", comp([1] * 60), CTX - 60),  # the default is capped at the room left
])
def test_omitted_max_new_tokens_defaults(client: httpx.Client, backend: SmallContext, path: str,
                                         body: dict[str, Any], expected: int) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert backend.inputs[0].sampling.max_new_tokens == expected


def test_without_a_context_length_the_configured_default_applies() -> None:
    backend = SmallContext(model_path=MODEL, context_length=None)
    for client in serve(backend, ApiConfig(default_max_new_tokens=5)):
        assert client.post("/generate", json=gen([1] * 500)).status_code == 200
        assert client.post("/v1/completions", json=comp([1] * 500)).status_code == 200
    assert [i.sampling.max_new_tokens for i in backend.inputs] == [5, 16]


def test_negative_max_new_tokens_is_still_named() -> None:
    with pytest.raises(ClientError, match="context length"):
        resolve_max_new_tokens(70, 1, 64, default=None, fallback=5)
    assert resolve_max_new_tokens(10, -1, 64, default=None, fallback=5) == -1  # validate() 400s


# -- the model name ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_another_model_name_is_404_naming_the_served_one(client: httpx.Client,
                                                        backend: SmallContext, path: str) -> None:
    body = comp([1, 2], 2, model="gpt-4") if "chat" not in path else chat("hi", 2, model="gpt-4")
    r = client.post(path, json=body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["message"].startswith("The model `gpt-4` does not exist.")
    assert MODEL in err["message"] and err["reason"] == "model_not_found"
    assert err["type"] == "not_found_error" and backend.inputs == []


def test_the_served_name_and_no_name_are_accepted(client: httpx.Client) -> None:
    assert client.post("/v1/completions", json=comp([1, 2], 2, model=MODEL)).json()["model"] \
        == MODEL
    assert client.post("/v1/chat/completions", json=chat("hi", 2)).json()["model"] == MODEL


def test_strict_model_name_false_accepts_any_name(backend: SmallContext) -> None:
    for client in serve(backend, ApiConfig(strict_model_name=False)):
        r = client.post("/v1/completions", json=comp([1, 2], 2, model="whatever"))
        assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize(("configured", "expected"), [(None, MODEL), ("tiny", "tiny")])
def test_one_name_on_every_info_route(backend: SmallContext, configured: str | None,
                                      expected: str) -> None:
    backend.extra_info = {"served_model_name": "dir-name"}  # a backend's own guess loses
    for client in serve(backend, ApiConfig(served_model_name=configured)):
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            assert client.get(path).json()["served_model_name"] == expected, path
        assert client.get("/v1/models").json()["data"][0]["id"] == expected
        r = client.post("/v1/completions", json=comp([1], 1, model=expected))
        assert r.status_code == 200 and r.json()["model"] == expected


def test_server_info_reports_the_cache_flags_the_backend_does_not(backend: SmallContext) -> None:
    flags = {"disaggregation_decode_enable_radix_cache": True, "enable_unified_radix_tree": True}
    backend.extra_info = {"enable_unified_radix_tree": False}
    for client in serve(backend, ApiConfig(server_info_defaults=flags)):
        info = client.get("/server_info").json()
        assert info["disaggregation_decode_enable_radix_cache"] is True
        assert info["enable_unified_radix_tree"] is False


def test_config_from_settings_carries_strictness_and_cache_flags() -> None:
    from decode_worker.settings import load_settings

    settings = load_settings(None, {"api.strict_model_name": False}).settings
    config = ApiConfig.from_settings(settings)
    assert config.strict_model_name is False
    cache_flags = {
        "disable_radix_cache": False, "disaggregation_decode_enable_radix_cache": True,
        "enable_unified_radix_tree": True, "enable_hierarchical_cache": True,
        "hicache_ratio": 2.0, "hicache_size": 0, "hicache_write_policy": "write_through"}
    assert {k: config.server_info_defaults[k] for k in cache_flags} == cache_flags
    assert config.server_info_defaults["speculative_algorithm"] is None
    sized = load_settings(None, {"cache.hicache_size_gb": 4.5,
                                 "cache.hicache_write_policy": "write_back"}).settings
    assert ApiConfig.from_settings(sized).server_info_defaults["hicache_size"] == 4.5
    off = load_settings(None, {"cache.decode_radix_cache": False}).settings
    assert ApiConfig.from_settings(off).server_info_defaults["enable_hierarchical_cache"] is False
    assert ApiConfig.from_settings(load_settings(None, {}).settings).strict_model_name is True
