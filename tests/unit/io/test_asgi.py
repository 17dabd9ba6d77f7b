"""The ASGI adapter under uvicorn (httptools) over real loopback sockets: requests, bodies,
responses, streams, disconnects, shutdown."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from decode_worker.daemon.shared.http_server import HttpServer, ServerConfig
from tests.fakes.fake_backend import ServerThread
from tests.unit.io.asgi_helpers import Handler, raw
from tests.waiting import wait_for


@pytest.fixture
def srv() -> Iterator[ServerThread]:
    with ServerThread(Handler(), ServerConfig(port=0, max_body_bytes=1000)) as s:
        yield s


def test_keep_alive_serves_many_requests_on_one_connection(srv: ServerThread) -> None:
    with httpx.Client(base_url=srv.url, timeout=5) as client:
        bodies = [client.post("/echo", content=f"n{i}".encode()).text for i in range(20)]
    assert bodies == [f"n{i}" for i in range(20)]


def test_pipelined_requests_are_answered_in_order(srv: ServerThread) -> None:
    req = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
    last = b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\ntwo"
    out = raw(srv.port, req + last)
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.index(b"one") < out.index(b"two")


def test_request_is_built_from_the_scope(srv: ServerThread) -> None:
    head = (b"GET /meta?a=1&b=%20 HTTP/1.1\r\nHost: x\r\nX-Rep: 1\r\nx-rep: 2\r\n"
            b"Connection: close\r\n\r\n")
    out = raw(srv.port, head)
    meta = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert (meta["method"], meta["path"], meta["query"]) == ("GET", "/meta", "a=1&b=%20")
    assert meta["version"] == "HTTP/1.1" and meta["headers"]["x-rep"] == "1, 2"
    host, port = meta["client"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert 0 < meta["received_at"] <= time.monotonic()


def test_chunked_request_body_is_read(srv: ServerThread) -> None:
    body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n"
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    out = raw(srv.port, head + body)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"hello world")


def test_oversized_body_gets_413_and_close(srv: ServerThread) -> None:
    r = httpx.post(srv.url + "/e", content=b"x" * 1001, timeout=5)
    assert r.status_code == 413
    assert "exceeds" in r.json()["error"]["message"]
    assert r.headers["connection"] == "close"


def test_oversized_chunked_body_gets_413(srv: ServerThread) -> None:
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    out = raw(srv.port, head + b"3e8\r\n" + b"x" * 1000 + b"\r\n10\r\n" + b"y" * 16 + b"\r\n")
    assert out.startswith(b"HTTP/1.1 413")
    assert srv.server.handler.seen == []  # type: ignore[attr-defined]


def test_expect_100_continue_is_answered(srv: ServerThread) -> None:
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
    out = raw(srv.port, head + b"Connection: close\r\n\r\nhi")
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")


def test_oversized_body_with_expect_gets_413_without_100(srv: ServerThread) -> None:
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
    assert raw(srv.port, head).startswith(b"HTTP/1.1 413")


def test_handler_exception_is_a_500_json(srv: ServerThread) -> None:
    r = httpx.get(srv.url + "/boom", timeout=5)
    assert r.status_code == 500 and r.json()["error"]["code"] == 500


def test_head_request_has_no_body(srv: ServerThread) -> None:
    out = raw(srv.port, b"HEAD /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = out.partition(b"\r\n\r\n")
    assert b"\r\ncontent-length: 4\r\n" in head + b"\r\n" and body == b""


def test_http10_without_keep_alive_closes(srv: ServerThread) -> None:
    out = raw(srv.port, b"GET /x HTTP/1.0\r\n\r\n")
    assert b"connection: close" in out and out.endswith(b"GET")


def test_responses_carry_the_server_name_and_a_date(srv: ServerThread) -> None:
    r = httpx.get(srv.url + "/x", timeout=5)
    assert r.headers["server"] == "decode-worker" and r.headers["date"].endswith("GMT")


def test_stream_is_chunked_and_complete(srv: ServerThread) -> None:
    with httpx.stream("GET", srv.url + "/stream", timeout=5) as r:
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["cache-control"] == "no-cache"
        text = "".join(r.iter_text())
    assert text == "".join(f"data: {i}\n\n" for i in range(5))


def test_response_header_injection_is_refused(srv: ServerThread) -> None:
    out = raw(srv.port, b"GET /inject HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"set-cookie" not in out.lower()
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def test_client_disconnect_cancels_a_running_handler() -> None:
    handler = Handler()
    with ServerThread(handler) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=3)
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        sock.close()
        wait_for(lambda: handler.cancelled == ["/slow"])


def test_client_half_close_counts_as_gone() -> None:
    handler = Handler()
    with ServerThread(handler) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=3)
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        sock.shutdown(socket.SHUT_WR)
        wait_for(lambda: handler.cancelled == ["/slow"])
        sock.close()


def test_client_disconnect_mid_stream_closes_the_stream() -> None:
    handler = Handler()
    with ServerThread(handler) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=3)
        sock.sendall(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"data: 0" not in got:
            got += sock.recv(4096)
        sock.close()
        wait_for(lambda: handler.closed_streams == 1)


def test_ok_answers_in_milliseconds_while_streams_run() -> None:
    handler = Handler()
    with ServerThread(handler) as srv, httpx.Client(base_url=srv.url, timeout=5) as probe:
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=3) for _ in range(8)]
        for sock in socks:
            sock.sendall(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: handler.seen.count("/endless") == 8)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert probe.get("/ok").status_code == 200
            times.append(time.perf_counter() - t0)
        for sock in socks:
            sock.close()
        assert sorted(times)[10] < 0.02, times  # median well under 20 ms
        wait_for(lambda: handler.closed_streams == 8)


def test_restarted_server_rebinds_the_same_port_at_once() -> None:
    with ServerThread(Handler()) as first:
        port = first.port
        with httpx.Client(base_url=first.url, timeout=5) as c:  # leaves TIME_WAIT behind
            assert c.get("/x").status_code == 200
    with ServerThread(Handler(), ServerConfig(port=port)) as second:
        assert httpx.get(second.url + "/x", timeout=5).status_code == 200


def test_start_on_a_taken_port_raises_oserror() -> None:
    async def main(port: int) -> None:
        await HttpServer(Handler(), ServerConfig(port=port)).start()

    with ServerThread(Handler()) as first, pytest.raises(OSError):
        asyncio.run(main(first.port))


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


def test_close_cancels_streams_past_the_grace() -> None:
    handler = Handler()

    async def main() -> float:
        server = HttpServer(handler, ServerConfig(port=0))
        await server.start()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            async def fetch() -> None:
                async with client.stream("GET", "/endless", timeout=5) as r:
                    async for _ in r.aiter_bytes():
                        pass
            task = asyncio.ensure_future(fetch())
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            await server.close(grace_s=0.3)
            took = time.monotonic() - t0
            with pytest.raises(httpx.HTTPError):
                await asyncio.wait_for(task, 3)
            return took

    assert asyncio.run(main()) < 2.0
    assert handler.closed_streams == 1
