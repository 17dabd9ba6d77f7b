"""The same server on uvloop (what the daemon runs): keep-alive, streams, disconnects, probes."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from decode_worker.daemon.shared.http_server import has_uvloop, run
from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.io.api.http_protocol import H2_PREFACE
from tests.fakes.fake_backend import FakeBackend, ServerThread
from tests.unit.io.test_api_generate import sse_events

pytestmark = pytest.mark.skipif(not has_uvloop(), reason="uvloop is not installed")


def test_api_on_uvloop_streams_and_aborts_on_disconnect() -> None:
    backend = FakeBackend(delay_s=0.02)
    with ServerThread(ApiApp(backend, ApiConfig()), uvloop=True) as srv:
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            for _ in range(3):  # keep-alive
                r = c.post("/generate", json={"text": "a", "stream": True,
                                              "sampling_params": {"max_new_tokens": 4}})
                assert sse_events(r.text)[-1] == "[DONE]"
        with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
            sock.sendall(H2_PREFACE)
            assert sock.recv(100)
        body = b'{"text": "a", "stream": true, "sampling_params": {"max_new_tokens": 500}}'
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=3)
        sock.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body), body))
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        sock.close()
        deadline = time.monotonic() + 3
        while not backend.aborts and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backend.aborts == [(backend.inputs[-1].rid, "client_abort")]


def test_run_uses_uvloop() -> None:
    import asyncio

    async def loop_type() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_type()).startswith("uvloop")
    assert run(loop_type(), use_uvloop=False).startswith("asyncio")
