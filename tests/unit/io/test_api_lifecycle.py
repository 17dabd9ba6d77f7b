"""Client disconnects abort, /health stays fast under a slow stream, HTTP/2 probes are harmless."""

from __future__ import annotations

import json
import socket
import time

import httpx

from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.io.api.http_protocol import H2_PREFACE
from decode_worker.io.metrics import Metrics
from tests.fakes.fake_backend import FakeBackend, ServerThread
from tests.waiting import wait_for


def _post_raw(port: int, path: str, body: dict[str, object]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock

def test_disconnect_mid_stream_aborts_the_request_on_every_endpoint() -> None:
    backend = FakeBackend(delay_s=0.1)
    bodies = {
        "/generate": {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 100}},
        "/v1/completions": {"prompt": "a", "stream": True, "max_tokens": 100},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}],
                                 "stream": True, "max_tokens": 100},
    }
    with ServerThread(ApiApp(backend, ApiConfig())) as srv:
        for n, (path, body) in enumerate(bodies.items(), start=1):
            sock = _post_raw(srv.port, path, body)
            got = b""
            while got.count(b"data: ") < 2:
                got += sock.recv(4096)
            sock.close()
            wait_for(lambda n=n: len(backend.aborts) == n and len(backend.closed) == n)
            assert backend.aborts[-1] == (backend.inputs[-1].rid, "client_abort")


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts() -> None:
    backend = FakeBackend(delay_s=0.1)
    with ServerThread(ApiApp(backend, ApiConfig())) as srv:
        sock = _post_raw(srv.port, "/generate", {"text": "a", "sampling_params": {
            "max_new_tokens": 100}})
        wait_for(lambda: len(backend.inputs) == 1)
        time.sleep(0.2)
        sock.close()
        wait_for(lambda: backend.aborts == [(backend.inputs[0].rid, "client_abort")])
        wait_for(lambda: backend.closed == [backend.inputs[0].rid])


def test_health_answers_in_milliseconds_while_a_slow_stream_runs() -> None:
    backend = FakeBackend(delay_s=0.05)
    with ServerThread(ApiApp(backend, ApiConfig())) as srv, \
            httpx.Client(base_url=srv.url, timeout=5) as probe, \
            httpx.Client(base_url=srv.url, timeout=10) as gen:
        probe.get("/health")  # connect once
        with gen.stream("POST", "/generate", json={
                "text": "a", "stream": True, "sampling_params": {"max_new_tokens": 40}}) as r:
            chunks = r.iter_bytes()
            next(chunks)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                assert probe.get("/health").status_code == 200
                times.append(time.perf_counter() - t0)
            times.sort()
            assert times[len(times) // 2] < 0.02, times  # median well under 20 ms
            for _ in chunks:
                pass


def test_http2_preface_from_router_probe_does_not_disturb_http() -> None:
    backend = FakeBackend()
    with ServerThread(ApiApp(backend, ApiConfig())) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
            sock.sendall(H2_PREFACE)
            assert sock.recv(100)  # SETTINGS + GOAWAY, then close
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200


def test_metrics_endpoint_counts_http_requests_and_latency() -> None:
    metrics = Metrics()
    backend = FakeBackend()
    with ServerThread(ApiApp(backend, ApiConfig(), metrics)) as srv, \
            httpx.Client(base_url=srv.url, timeout=5) as c:
        c.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 3}})
        c.post("/generate", content=b"{")
        c.get("/nope")
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'decode_worker_http_requests_total{code="200",endpoint="generate"} 1.0' in text
    assert 'decode_worker_http_requests_total{code="400",endpoint="generate"} 1.0' in text
    assert 'decode_worker_http_requests_total{code="404",endpoint="other"} 1.0' in text
    assert "decode_worker_time_to_first_token_seconds_count 1.0" in text
    assert "decode_worker_inter_token_latency_seconds_count 2.0" in text
    assert "decode_worker_request_e2e_seconds_count 1.0" in text


def test_metrics_disabled_is_404() -> None:
    app = ApiApp(FakeBackend(), ApiConfig(metrics_enabled=False), Metrics())
    with ServerThread(app) as srv:
        assert httpx.get(srv.url + "/metrics", timeout=5).status_code == 404


def test_closing_an_unstarted_stream_still_aborts_the_run() -> None:
    import asyncio

    from decode_worker.core.sampling import SamplingParams
    from decode_worker.io.api.backend import GenerateInput
    from decode_worker.io.api.common import RunStream
    from decode_worker.io.api.generate import _stream
    from decode_worker.io.api.run import GenerationRun

    backend = FakeBackend()

    async def main() -> None:
        run = GenerationRun(backend, GenerateInput("r", [1], SamplingParams(max_new_tokens=9)))
        await run.start()
        stream = RunStream(_stream([run], False), [run])
        await stream.aclose()  # the client left before the first byte was written
        await stream.aclose()  # idempotent

    asyncio.run(main())
    assert backend.aborts == [("r", "client_abort")] and backend.closed == ["r"]


def test_configs_from_settings(tmp_path: object) -> None:
    from decode_worker.daemon.shared.http_server import ServerConfig
    from decode_worker.io.api import check_model_path
    from decode_worker.settings import load_settings

    s = load_settings(overrides={"server.api_key": "k", "server.max_body_bytes": 123,
                                 "scheduler.max_prompt_tokens": 9}, environ={}).settings
    api = ApiConfig.from_settings(s)
    assert (api.api_key, api.max_prompt_tokens, api.default_max_new_tokens) == ("k", 9, 128)
    srv = ServerConfig.from_settings(s)
    assert (srv.host, srv.max_body_bytes) == ("127.0.0.1", 123)
    assert check_model_path({"model_path": "/nonexistent"}) is not None
    from pathlib import Path

    d = Path(str(tmp_path))
    (d / "tokenizer.json").write_text("{}")
    assert check_model_path({"model_path": str(d)}) is None


def test_backend_abort_finish_is_a_200_with_abort_reason() -> None:
    from decode_worker.io.api.backend import OutputChunk

    class Aborting(FakeBackend):
        async def _run(self, inp):  # type: ignore[no-untyped-def, override]
            yield OutputChunk(token_ids=[72], prompt_tokens=1)
            yield OutputChunk(finish_reason="abort", prompt_tokens=1)

    with ServerThread(ApiApp(Aborting(), ApiConfig())) as srv, \
            httpx.Client(base_url=srv.url, timeout=5) as c:
        g = c.post("/generate", json={"text": "a"}).json()
        assert g["text"] == "H" and g["meta_info"]["finish_reason"]["type"] == "abort"
        o = c.post("/v1/completions", json={"prompt": "a"}).json()
        assert o["choices"][0]["finish_reason"] == "abort"
