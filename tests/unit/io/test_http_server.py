"""The asyncio HTTP/1.1 server over real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.io.http import HttpServer, Request, Response, ServerConfig, StreamResponse
from decode_worker.io.http.message import HttpError
from decode_worker.io.http.parse import H2_PREFACE, H2Preface, body_length, parse_head
from tests.fakes.fake_backend import ServerThread
from tests.waiting import wait_for


class Handler:
    """Echoes the body; /stream streams 5 chunks slowly; records cancellations."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.closed_streams = 0

    async def __call__(self, req: Request) -> Response | StreamResponse:
        if req.path == "/stream":
            return StreamResponse(200, self._chunks())
        if req.path == "/slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append(req.path)
                raise
        if req.path == "/boom":
            raise RuntimeError("handler bug")
        return Response(200, req.body or req.method.encode(), "text/plain")

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            for i in range(5):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.2)
        finally:
            self.closed_streams += 1


@pytest.fixture
def srv() -> ServerThread:
    with ServerThread(Handler(), ServerConfig(port=0, max_body_bytes=1000)) as s:
        yield s  # type: ignore[misc]


def _raw(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_keep_alive_serves_many_requests_on_one_connection(srv: ServerThread) -> None:
    with httpx.Client(base_url=srv.url, timeout=5) as client:
        bodies = [client.post("/echo", content=f"n{i}".encode()).text for i in range(20)]
    assert bodies == [f"n{i}" for i in range(20)]


def test_pipelined_requests_are_answered_in_order(srv: ServerThread) -> None:
    req = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
    last = b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\ntwo"
    out = _raw(srv.port, req + last)
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.index(b"one") < out.index(b"two")


def test_chunked_request_body_is_read(srv: ServerThread) -> None:
    body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n"
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    out = _raw(srv.port, head + body)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"hello world")


def test_oversized_body_gets_413_and_close(srv: ServerThread) -> None:
    r = httpx.post(srv.url + "/e", content=b"x" * 1001, timeout=5)
    assert r.status_code == 413
    assert "exceeds" in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"


def test_oversized_chunked_body_gets_413(srv: ServerThread) -> None:
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    out = _raw(srv.port, head + b"3e8\r\n" + b"x" * 1000 + b"\r\n10\r\n" + b"y" * 16 + b"\r\n")
    assert out.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize("garbage", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n",  # TLS hello
    b"GET\r\n\r\n",
    b"GET / HTTP/1.1\r\nbad header line\r\n\r\n",
    b"GET / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"GET / HTTP/3.0\r\n\r\n",
    b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",  # 431
    b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",  # 501
], ids=["tls", "no-version", "bad-header", "cl-and-te", "negative-cl", "http3", "huge-head",
        "gzip-te"])
def test_malformed_requests_get_4xx_or_5xx_and_server_survives(
    srv: ServerThread, garbage: bytes
) -> None:
    out = _raw(srv.port, garbage)
    assert out.startswith((b"HTTP/1.1 4", b"HTTP/1.1 501", b"HTTP/1.1 505")), out[:80]
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def test_http2_preface_gets_goaway_and_server_survives(srv: ServerThread) -> None:
    out = _raw(srv.port, H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    assert out[3] == 0x04 and out[12] == 0x07  # SETTINGS, then GOAWAY
    assert out[-4:] == b"\x00\x00\x00\x0d"  # HTTP_1_1_REQUIRED
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def test_half_sent_head_then_close_does_not_crash(srv: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nContent-Le")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def test_stalled_body_is_dropped_after_the_read_timeout() -> None:
    with ServerThread(Handler(), ServerConfig(port=0, read_timeout_s=0.2)) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 100\r\n\r\nonly-part")
            t0 = time.monotonic()
            assert sock.recv(100) == b""  # closed, no answer
            assert time.monotonic() - t0 < 2.0
        assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def test_expect_100_continue_is_answered(srv: ServerThread) -> None:
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
    out = _raw(srv.port, head + b"Connection: close\r\n\r\nhi")
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")


def test_handler_exception_is_a_500_json(srv: ServerThread) -> None:
    r = httpx.get(srv.url + "/boom", timeout=5)
    assert r.status_code == 500 and r.json()["error"]["code"] == 500


def test_head_request_has_no_body(srv: ServerThread) -> None:
    out = _raw(srv.port, b"HEAD /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.endswith(b"content-length: 4\r\n\r\n")


def test_http10_without_keep_alive_closes(srv: ServerThread) -> None:
    out = _raw(srv.port, b"GET /x HTTP/1.0\r\n\r\n")
    assert b"connection: close" in out and out.endswith(b"GET")


def test_stream_is_chunked_and_complete(srv: ServerThread) -> None:
    with httpx.stream("GET", srv.url + "/stream", timeout=5) as r:
        assert r.headers["transfer-encoding"] == "chunked"
        text = "".join(r.iter_text())
    assert text == "".join(f"data: {i}\n\n" for i in range(5))


def test_client_disconnect_cancels_a_running_handler() -> None:
    handler = Handler()
    with ServerThread(handler) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=3)
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        sock.close()
        wait_for(lambda: handler.cancelled == ["/slow"])


def test_client_disconnect_mid_stream_closes_the_stream() -> None:
    handler = Handler()
    with ServerThread(handler) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=3)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"data: 0" not in got:
            got += sock.recv(4096)
        sock.close()
        wait_for(lambda: handler.closed_streams == 1)


def test_restarted_server_rebinds_the_same_port_at_once() -> None:
    with ServerThread(Handler()) as first:
        port = first.port
        with httpx.Client(base_url=first.url, timeout=5) as c:  # leaves TIME_WAIT behind
            assert c.get("/x").status_code == 200
    with ServerThread(Handler(), ServerConfig(port=port)) as second:
        assert httpx.get(second.url + "/x", timeout=5).status_code == 200


def test_close_waits_for_in_flight_stream_within_grace() -> None:
    async def main() -> tuple[str, float]:
        server = HttpServer(Handler(), ServerConfig(port=0))
        await server.start()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            async def fetch() -> str:
                return (await client.get("/stream", timeout=5)).text
            task = asyncio.ensure_future(fetch())
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await server.close(grace_s=3.0)
            return await task, time.monotonic() - t0

    text, waited = asyncio.run(main())
    assert text.endswith("data: 4\n\n") and waited < 2.5

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_parse_head_raises_only_http_errors_on_any_bytes(raw: bytes) -> None:
    try:
        head = parse_head(raw)
    except (HttpError, H2Preface):
        return
    assert head.version in ("HTTP/1.0", "HTTP/1.1")
    with contextlib.suppress(HttpError):
        body_length(head.headers)


def test_random_garbage_connections_leave_the_server_serving(srv: ServerThread) -> None:
    rng = random.Random(7)
    for _ in range(30):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
            sock.sendall(junk + b"\r\n\r\n")
            with contextlib.suppress(OSError):
                sock.recv(1000)
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200
