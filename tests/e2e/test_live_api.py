"""The real decode worker over HTTP: the three generation endpoints, streaming and not, bad
input, the info endpoints, and client disconnects (issue 7). One server per module."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decode_worker.device.tokenizer import Tokenizer
from tests.e2e.conftest import assert_top_logprobs_match
from tests.e2e.live_fixtures import DONE, Live, gen_body, live_server, raw_stream

pytestmark = pytest.mark.slow
PROMPT = [3 + (i * 7) % 250 for i in range(40)]
LONG = [3 + (i * 11) % 250 for i in range(400)]  # past window + page: a repeat hits the cache
N = 12
CONTEXT = 4096  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def api(plain_live: Live) -> Live:
    return plain_live


@pytest.fixture(scope="module")
def reference(api: Live) -> dict[str, Any]:
    """Non-streaming greedy /generate of PROMPT with logprobs: what every endpoint must match."""
    resp = api.post("/generate", gen_body(PROMPT, N, return_logprob=True))
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_generate_non_streaming_shape(reference: dict[str, Any]) -> None:
    meta = reference["meta_info"]
    assert len(reference["output_ids"]) == N
    assert isinstance(reference["text"], str)
    assert meta["finish_reason"] == {"type": "length", "length": N}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), N)
    assert meta["cached_tokens"] == 0
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == reference["output_ids"]
    assert all(len(t) == 3 and t[2] is None and isinstance(t[0], float) and t[0] <= 0
               for t in triples)


def test_generate_stream_equals_non_stream(api: Live, reference: dict[str, Any]) -> None:
    events = api.sse("/generate", gen_body(PROMPT, N, stream=True, return_logprob=True,
                                           rid="live-stream-1"))
    assert events[-1] == DONE and all(isinstance(e, dict) for e in events[:-1])
    bodies = events[:-1]
    for prev, cur in itertools.pairwise(bodies):  # cumulative output
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    last = bodies[-1]
    assert last["output_ids"] == reference["output_ids"]
    assert last["text"] == reference["text"]
    assert last["meta_info"]["id"] == "live-stream-1"
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": N}
    got = last["meta_info"]["output_token_logprobs"]
    want = reference["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in got] == [t[1] for t in want]
    assert [t[0] for t in got] == pytest.approx([t[0] for t in want], abs=1e-4)


def test_completions_match_generate(api: Live, reference: dict[str, Any],
                                    e2e_model_dir: Path) -> None:
    body = {"prompt": PROMPT, "max_completion_tokens": N, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "model": str(e2e_model_dir)}  # the served name: the model path
    resp = api.post("/v1/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "text_completion"
    choice = out["choices"][0]
    assert choice["text"] == reference["text"] and choice["finish_reason"] == "length"
    want_lps = [t[0] for t in reference["meta_info"]["output_token_logprobs"]]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want_lps, abs=1e-4)
    # the reference ran the same prompt: every whole page of it is reused (issue 12)
    assert out["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": N,
                            "total_tokens": len(PROMPT) + N,
                            "prompt_tokens_details": {"cached_tokens": len(PROMPT) // 16 * 16}}
    events = api.sse("/v1/completions", {**body, "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert events[-1] == DONE
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == reference["text"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == N


def test_chat_matches_generate_on_template_ids(api: Live, e2e_model_dir: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    tok = Tokenizer.from_dir(e2e_model_dir)
    ids = tok.encode(tok.apply_chat_template(messages))
    ref = api.post("/generate", gen_body(ids, N)).json()
    # the raw text (no reasoning split): the tiny model's random output is no harmony; its
    # parsing is tested in test_harmony_api.py and test_openai_sdk.py
    body = {"messages": messages, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "separate_reasoning": False}
    out = api.post("/v1/chat/completions", body).json()
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": ref["text"]}
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == N
    assert "cached_tokens" in out["usage"]["prompt_tokens_details"]
    events = api.sse("/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == DONE
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == ref["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("max_new", [1, 7, 33])
def test_ignore_eos_gives_exactly_max_new_tokens(api: Live, max_new: int) -> None:
    out = api.post("/generate", gen_body(PROMPT[:9], max_new)).json()
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == max_new


def test_unknown_fields_are_ignored(api: Live, reference: dict[str, Any]) -> None:
    junk = {"bootstrap_pair_key": "x", "lora_path": None, "frobnicate": [1, {"a": 2}]}
    body = gen_body(PROMPT, N, **junk)
    body["sampling_params"]["no_such_param"] = 3
    assert api.post("/generate", body).json()["output_ids"] == reference["output_ids"]
    comp = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "user": "u1", "presence_penalty": 0.0, **junk}
    assert api.post("/v1/completions", comp).json()["choices"][0]["text"] == reference["text"]
    chat = {"messages": [{"role": "user", "content": "x", "name": "n"}], "max_tokens": 2,
            "tools": [], "response_format": {"type": "text"}, **junk}
    assert api.post("/v1/chat/completions", chat).status_code == 200


def test_repeated_long_prompt_reports_cached_tokens(api: Live) -> None:
    first = api.post("/generate", gen_body(LONG, 2)).json()["meta_info"]
    usage = api.post("/v1/completions", {"prompt": LONG, "max_tokens": 2, "temperature": 0,
                                         "ignore_eos": True}).json()["usage"]
    assert first["cached_tokens"] == 0 or first["cached_tokens"] < len(LONG)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= len(LONG) and cached % 16 == 0, usage  # every whole page


BATCH_PROMPTS = [[3 + (i * (k + 3)) % 250 for i in range(20 + 37 * k)] for k in range(8)]


def test_concurrent_requests_decode_as_if_alone(api: Live) -> None:
    """8 requests in one decode batch (prompts 20..279 tokens, past the window) give the same
    greedy tokens as each alone, logprobs within float noise."""
    alone = [api.post(GEN, gen_body(p, 24, return_logprob=True)).json() for p in BATCH_PROMPTS]
    together: list[Any] = [None] * len(BATCH_PROMPTS)

    def run(k: int) -> None:
        together[k] = httpx.post(f"{api.url}{GEN}", timeout=60,
                                 json=gen_body(BATCH_PROMPTS[k], 24, return_logprob=True)).json()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(BATCH_PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for k, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b is not None and b["output_ids"] == a["output_ids"], k
        lps = [[t[0] for t in x["meta_info"]["output_token_logprobs"]] for x in (a, b)]
        assert lps[1] == pytest.approx(lps[0], abs=1e-3), k


@pytest.mark.parametrize("k", [0, 7])
def test_greedy_tokens_equal_the_reference_implementation(api: Live, reference_greedy: Any,
                                                          k: int) -> None:
    """Local prefill + decode on the worker vs transformers on the same weights."""
    out = api.post(GEN, gen_body(BATCH_PROMPTS[k], 16)).json()
    tokens, _ = reference_greedy(BATCH_PROMPTS[k], 16)
    assert out["output_ids"] == tokens


def test_top_logprobs_equal_the_reference_implementation(api: Live, reference_run: Any) -> None:
    """Every token's 5 most likely alternatives (the first from the local prefill) against
    transformers' log-softmax of the same step."""
    out = api.post(GEN, gen_body(BATCH_PROMPTS[3], 6, return_logprob=True,
                                 top_logprobs_num=5)).json()
    tokens, lps = reference_run(BATCH_PROMPTS[3], 6)
    assert out["output_ids"] == tokens
    assert_top_logprobs_match(out["meta_info"]["output_top_logprobs"], lps, 5, tol=1e-4)


# -- info endpoints ------------------------------------------------------------------------


def test_info_endpoints(api: Live, e2e_model_dir: Path) -> None:
    assert api.get("/health").status_code == 200
    assert api.get("/health_generate").status_code == 200
    for path in ("/server_info", "/get_server_info"):
        info = api.get(path).json()
        assert (Path(info["model_path"]) / "tokenizer.json").is_file()
        assert info["disaggregation_mode"] == "decode"
        assert info["tp_size"] == 1 and info["dp_size"] == 1
        assert info["served_model_name"] == str(e2e_model_dir)  # SGLang's default: the path
        assert info["context_length"] == CONTEXT
        assert info["disaggregation_decode_enable_radix_cache"] is True
        assert info["enable_unified_radix_tree"] is True
        assert info["enable_hierarchical_cache"] is True  # on by default with the radix cache
        assert info["hicache_write_policy"] == "write_through" and info["hicache_size"] == 0
        host = info["host_tier"]
        assert host["enabled"] is True and host["num_pages"] > 0
        assert host["max_tokens"] == host["num_pages"] * info["page_size"]
        assert 0 <= host["pages_used"] <= host["num_pages"]
    for path in ("/model_info", "/get_model_info"):
        model = api.get(path).json()
        assert (Path(model["tokenizer_path"]) / "tokenizer.json").is_file()
        assert model["is_generation"] is True
        assert model["served_model_name"] == str(e2e_model_dir)
    models = api.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["id"] == str(e2e_model_dir)
    metrics = api.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "decode_worker_kv_pages_capacity" in metrics.text


def test_wrong_method_and_path(api: Live) -> None:
    resp = api.get("/generate")
    assert resp.status_code == 405 and "POST" in resp.headers["allow"]
    assert api.get("/nope").status_code == 404
    assert "message" in api.get("/nope").json()["error"]


# -- bad input: 4xx with a JSON message, and the server keeps serving ------------------------

GEN, COMP, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
BAD = [
    (GEN, b"{bad json", 400, "malformed"),
    (GEN, b"", 400, "empty"),
    (GEN, b"[1, 2]", 400, "object"),
    (GEN, b'{"input_ids": "abc"}', 400, "input_ids"),
    (GEN, b'{"input_ids": [1, 2.5]}', 400, "input_ids"),
    (GEN, b'{"input_ids": []}', 400, "empty"),
    (GEN, b'{"text": ""}', 400, "empty"),
    (GEN, b'{"text": "a", "input_ids": [1]}', 400, "exactly one"),
    (GEN, b'{"input_ids": [-1, 2]}', 400, "non-negative"),
    (GEN, b'{"input_ids": [1, 99999]}', 400, "vocab"),
    (GEN, b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', 400, "temperature"),
    (GEN, b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', 400, "temperature"),
    (GEN, b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', 400, "top_p"),
    (GEN, b'{"input_ids": [1], "sampling_params": {"top_k": 0}}', 400, "top_k"),
    (GEN, b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}', 400, "max_new"),
    (GEN, b'{"input_ids": [1], "sampling_params": {"n": 0}}', 400, "n=0"),
    (GEN, b'{"input_ids": [1], "bootstrap_room": -5}', 400, "bootstrap_room"),
    (GEN, b'{"input_ids": [1], "bootstrap_host": "", "bootstrap_port": 9, "bootstrap_room": 2}',
     400, "bootstrap"),
    (COMP, b'{"prompt": ""}', 400, "empty"),
    (COMP, b'{"max_tokens": 2}', 400, "prompt"),
    (COMP, b'{"prompt": [1, 2], "temperature": -0.5}', 400, "temperature"),
    (COMP, b'{"prompt": [1, 2], "top_p": 0}', 400, "top_p"),
    (COMP, b'{"prompt": [1, 2], "max_completion_tokens": "many"}', 400, "max_completion"),
    (COMP, b'{"prompt": [[1], "x"]}', 400, "prompt"),
    (CHAT, b'{"messages": []}', 400, "messages"),
    (CHAT, b'{"messages": "hi"}', 400, "messages"),
    (CHAT, b'{"messages": [{"content": "no role"}]}', 400, "role"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_k": 0}', 400, "top_k"),
]


@pytest.mark.parametrize(("path", "raw", "status", "word"), BAD,
                         ids=[f"{p}:{r[:40]!r}" for p, r, _, _ in BAD])
def test_bad_input_is_4xx_with_message(api: Live, path: str, raw: bytes, status: int,
                                       word: str) -> None:
    resp = api.post(path, raw=raw)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert word.lower() in err["message"].lower(), err
    assert api.get("/health").status_code == 200


@pytest.fixture(scope="module")
def small(e2e_model_dir: Path) -> Iterator[Live]:
    """A second worker with a prompt limit, a small body limit, an API key, a full pool
    smaller than the model's context and any model name accepted."""
    with live_server(e2e_model_dir, "--set", "scheduler.max_prompt_tokens=64",
                     "--set", "server.max_body_bytes=65536", "--set",
                     f"cache.num_full_pages={SMALL_POOL_TOKENS // 16}",
                     "--set", "api.strict_model_name=false", name="small",
                     api_key=API_KEY) as live:
        yield live


API_KEY = "s3cret-live"
SMALL_POOL_TOKENS = 2048  # < CONTEXT: a request can fit the context and not the pool


def test_api_key_guards_generation_but_not_probes(small: Live) -> None:
    body = gen_body([5, 6], 2)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
        for path in (GEN, COMP):
            resp = httpx.post(f"{small.url}{path}", json=body, headers=headers, timeout=10)
            assert resp.status_code == 401 and resp.json()["error"]["message"], (path, headers)
    assert httpx.get(f"{small.url}/v1/models", timeout=10).status_code == 401
    for path in ("/health", "/health_generate", "/server_info", "/model_info", "/metrics"):
        assert httpx.get(f"{small.url}{path}", timeout=10).status_code == 200, path
    assert small.post(GEN, body).status_code == 200  # with the key
    assert API_KEY not in small.proc.output()


def test_prompt_over_max_prompt_tokens_is_413(small: Live) -> None:
    for path, body in ((GEN, {"input_ids": [5] * 65}), (COMP, {"prompt": [5] * 65}),
                       (GEN, {"text": "word " * 200})):
        resp = small.post(path, body)
        assert resp.status_code == 413, resp.text
        assert "64" in resp.json()["error"]["message"]
    assert small.post(GEN, gen_body([5] * 64, 2)).status_code == 200


def test_request_larger_than_the_pool_is_413(small: Live) -> None:
    resp = small.post(GEN, gen_body(PROMPT, SMALL_POOL_TOKENS + 100))  # fits the context
    assert resp.status_code == 413, resp.text
    assert "pool" in resp.json()["error"]["message"]
    assert small.post(GEN, gen_body(PROMPT, 2)).status_code == 200


@pytest.mark.parametrize("path", [GEN, COMP])
def test_streaming_request_too_large_for_the_pool_is_413_not_a_200_stream(small: Live,
                                                                          path: str) -> None:
    """Admission (on the compute thread) rejects it before any token: a plain HTTP error."""
    body: dict[str, Any] = {"stream": True}
    new = SMALL_POOL_TOKENS + 100
    if path == GEN:
        body.update(gen_body(PROMPT, new))
    else:
        body.update(prompt=PROMPT, max_tokens=new, temperature=0, ignore_eos=True)
    resp = small.post(path, body)
    assert resp.status_code == 413, resp.text
    assert "pool" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path", [GEN, COMP, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_past_the_context_length_is_400_naming_the_numbers(api: Live, path: str,
                                                           stream: bool) -> None:
    new = CONTEXT - len(PROMPT) + 1 if path != CHAT else CONTEXT  # the chat prompt is shorter
    body: dict[str, Any] = {"stream": stream, "max_tokens": new, "temperature": 0}
    if path == GEN:
        body = {**gen_body(PROMPT, new), "stream": stream}
    elif path == COMP:
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    resp = api.post(path, body)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert str(CONTEXT) in message and str(new) in message, message
    assert api.post(GEN, gen_body([7] * (CONTEXT + 1), 1)).status_code == 400  # prompt alone
    # exactly at the limit is accepted: read its first event, then leave (that aborts it)
    at_limit = {**gen_body(PROMPT, CONTEXT - len(PROMPT)), "stream": True}
    raw_stream(api.port, GEN, at_limit, events=1).close()


def test_completions_default_to_16_tokens(api: Live) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    out = api.post(COMP, body).json()
    assert out["usage"]["completion_tokens"] == 16, out


def test_model_name_is_checked_unless_strict_is_off(api: Live, small: Live,
                                                   e2e_model_dir: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "model": "whatever"}
    resp = api.post(COMP, body)
    assert resp.status_code == 404, resp.text
    message = resp.json()["error"]["message"]
    assert "The model `whatever` does not exist." in message and str(e2e_model_dir) in message
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "x"}
    assert api.post(CHAT, chat).status_code == 404
    resp = small.post(COMP, body)  # api.strict_model_name=false
    assert resp.status_code == 200 and resp.json()["model"] == str(e2e_model_dir), resp.text


def test_oversized_body_is_413_and_server_serves(small: Live) -> None:
    resp = small.post(GEN, raw=b'{"text": "' + b"a" * 70000 + b'"}')
    assert resp.status_code == 413
    assert "exceeds" in resp.json()["error"]["message"]
    assert small.post(GEN, gen_body([5, 6], 2)).status_code == 200


def _raw_exchange(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send bytes on a fresh connection; read until the server closes it (or timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        got, deadline = b"", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            got += chunk
        return got


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.mark.parametrize("data", [
    H2_PREFACE,
    b"GARBAGE\r\n\r\n",
    b"POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /generate HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"inp",  # truncated body
    b"POST /generate HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS ClientHello
], ids=["h2-preface", "garbage", "bad-chunk", "truncated", "neg-length", "tls"])
def test_protocol_garbage_does_not_kill_the_server(api: Live, data: bytes) -> None:
    got = _raw_exchange(api.port, data)
    if got.startswith(b"HTTP/1.1"):
        assert got.split(b" ", 2)[1].startswith(b"4"), got[:200]
    assert api.get("/health").status_code == 200
    assert api.post(GEN, gen_body(PROMPT[:5], 2)).status_code == 200


def test_server_log_has_no_traceback_after_bad_input(api: Live) -> None:
    out = api.proc.output()
    assert "Traceback" not in out, out[-3000:]
    assert json.dumps("engine stopped") not in out
