"""POST /v1/completions and /v1/chat/completions, streaming and not, over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from decode_worker.io.api import ApiApp, ApiConfig
from tests.fakes.fake_backend import FakeBackend, ServerThread
from tests.unit.io.test_api_generate import sse_events


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(cached_tokens=3)


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[httpx.Client]:
    app = ApiApp(backend, ApiConfig(served_model_name="tiny", default_max_new_tokens=5))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c:
        yield c


def test_completions_non_streaming(client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 4,
                                             "echo": False, "no_stop_trim": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["text"] == "Hell" and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert backend.inputs[0].input_ids == list(b"abc")


def test_completions_prompt_as_token_ids_and_logprobs(client: httpx.Client,
                                                      backend: FakeBackend) -> None:
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert backend.inputs[0].input_ids == [5, 6]


def test_completions_streaming_with_usage(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-2]]  # type: ignore[index]
    assert "".join(texts) == "Hel"
    assert events[-3]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    usage = events[-2]["usage"]  # type: ignore[index]
    assert usage["completion_tokens"] == 3 and events[-2]["choices"] == []  # type: ignore[index]


def test_chat_non_streaming_uses_template_and_max_completion_tokens(
    client: httpx.Client, backend: FakeBackend
) -> None:
    parts = [{"type": "text", "text": "hi"}]
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": parts}],
        "max_completion_tokens": 2, "max_tokens": 9, "separate_reasoning": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "He"}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    prompt = bytes(backend.inputs[0].input_ids).decode()
    assert prompt == "<system>be brief\n<user>hi\n<assistant>"
    assert backend.inputs[0].sampling.max_new_tokens == 2


def test_chat_streaming_role_then_deltas_then_finish(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "logprobs": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)  # type: ignore[index]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)  # type: ignore[index]
    assert content == "Hel"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert chunks[1]["choices"][0]["logprobs"]["content"][0]["token"] == "H"  # type: ignore[index]


def test_chat_stop_strings_list(client: httpx.Client, backend: FakeBackend) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stop": ["zz", "lo"]})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hel" and choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == "lo" and backend.finished


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/v1/completions", {"prompt": ["a", [1]]}, "a batch"),
    ("/v1/completions", {"prompt": []}, "a batch"),
    ("/v1/completions", {}, "prompt is required"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n=0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3,
                              "bootstrap_room": [3, 4]}, "2 entries for 3 samples"),
    ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": []}, "non-empty"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": "hi"}, "$.messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]}, "image_url"),
])
def test_bad_openai_requests_get_400(client: httpx.Client, path: str, body: object,
                                     needle: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_api_key_guards_generation_but_not_health(backend: FakeBackend) -> None:
    app = ApiApp(backend, ApiConfig(api_key="s3cret"))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c:
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/completions", json={"prompt": "a"},
                    headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200


def test_streamed_logprobs_cover_tokens_whose_text_was_held(client: httpx.Client,
                                                           backend: FakeBackend) -> None:
    backend.reply = "é€x".encode()  # 6 tokens, but only 3 text deltas
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 6, "stream": True,
                                             "logprobs": 1})
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks]  # type: ignore[index]
    assert texts == ["é", "€", "x"]
    counts = [len(c["choices"][0]["logprobs"]["token_logprobs"]) for c in chunks]  # type: ignore[index]
    assert counts == [2, 3, 1]


def test_completions_logprobs_n_gives_n_alternatives_per_token(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"H": -0.5, "I": -1.5}, {"e": -0.5, "f": -1.5}]


def test_chat_top_logprobs_streamed_and_whole(client: httpx.Client) -> None:
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
           "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=req).json()["choices"][0]["logprobs"][
        "content"]
    assert content[0]["top_logprobs"] == [
        {"token": "H", "logprob": -0.5, "bytes": [72]},
        {"token": "I", "logprob": -1.5, "bytes": [73]}]
    assert [len(c["top_logprobs"]) for c in content] == [2, 2]
    chunks = [e for e in sse_events(client.post("/v1/chat/completions",
                                                json={**req, "stream": True}).text)
              if e != "[DONE]"]
    streamed = [c for ch in chunks if (ch["choices"] and ch["choices"][0]["logprobs"])  # type: ignore[index]
                for c in ch["choices"][0]["logprobs"]["content"]]  # type: ignore[index]
    assert [c["top_logprobs"] for c in streamed] == [c["top_logprobs"] for c in content]
    no_lp = client.post("/v1/chat/completions", json={**req, "logprobs": False})
    assert no_lp.status_code == 400 and "logprobs=true" in no_lp.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_streamed_text_with_unicode_line_ends_stays_one_event_per_line(path: str) -> None:
    """A generated text may hold NEL, LINE SEPARATOR or PARAGRAPH SEPARATOR: JSON allows them
    raw, but a client that splits the stream with `str.splitlines` (httpx's `iter_lines`)
    would cut the event there. They go out as JSON escapes, and decode to the same text."""
    text = "a\u2028b\x85c\u2029d"
    backend = FakeBackend(reply=text.encode())
    app = ApiApp(backend, ApiConfig(served_model_name="tiny", default_max_new_tokens=5))
    body = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "hi"} if path.startswith("/v1") else {"text": "hi"})
    n = len(text.encode())  # the fake's tokens are bytes
    body |= {"stream": True, "max_tokens": n} if path.startswith("/v1") else {
        "stream": True, "sampling_params": {"max_new_tokens": n}}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=5) as c, c.stream(
            "POST", path, json=body) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    if path == "/generate":
        assert events[-1]["text"] == text
        return
    key = "content" if "chat" in path else "text"
    got = "".join((e["choices"][0].get("delta") or e["choices"][0]).get(key) or ""
                  for e in events if e["choices"])
    assert got == text
