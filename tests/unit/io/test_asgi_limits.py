"""What the server refuses before a handler runs: malformed heads (400, bare LF included),
oversized heads (431), HTTP/2 probes (GOAWAY), slow or idle clients (408 / close)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.server import ServerState

from decode_worker.daemon.shared.http_server import ServerConfig
from decode_worker.io.api.asgi import AsgiApp
from decode_worker.io.api.http_protocol import H2_PREFACE, limited_protocol
from tests.examples import examples
from tests.fakes.fake_backend import ServerThread
from tests.unit.io.asgi_helpers import Handler, raw, recv_until_closed


@pytest.fixture
def srv() -> Iterator[ServerThread]:
    with ServerThread(Handler(), ServerConfig(port=0, max_head_bytes=16 * 1024)) as s:
        yield s


@pytest.mark.parametrize("garbage", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n",  # TLS hello
    b"GET\r\n\r\n",
    b"GET / HTTP/1.1\r\nbad header line\r\n\r\n",
    b"GET / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"GET / HTTP/3.0\r\n\r\n",
    b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",  # 431
    b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"GET / HTTP/1.1\r\nx-a: 1\r\n folded\r\n\r\n",  # obs-fold
    b"GET / HTTP/1.1\r\nx-a: 1\rx\r\n\r\n",  # CR without LF
], ids=["tls", "no-version", "bad-header", "cl-and-te", "negative-cl", "http3", "huge-head",
        "gzip-te", "obs-fold", "bare-cr"])
def test_malformed_requests_get_4xx_and_server_survives(
    srv: ServerThread, garbage: bytes
) -> None:
    out = raw(srv.port, garbage)
    assert out.startswith(b"HTTP/1.1 4"), out[:80]
    assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == int(out[9:12])
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200
    assert srv.server.handler.seen == ["/ok"]  # type: ignore[attr-defined]


def test_bare_lf_in_a_header_value_cannot_smuggle_a_header(srv: ServerThread) -> None:
    head = b"POST /e HTTP/1.1\r\nHost: x\r\nx-a: 1\nTransfer-Encoding: chunked\r\n"
    out = raw(srv.port, head + b"Content-Length: 3\r\n\r\nabc")
    assert out.startswith(b"HTTP/1.1 400"), out[:80]
    assert srv.server.handler.seen == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("head", [
    b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(101)) + b"\r\n",
], ids=["one-big-field", "long-target", "101-fields"])
def test_oversized_head_gets_431(srv: ServerThread, head: bytes) -> None:
    assert raw(srv.port, head).startswith(b"HTTP/1.1 431")


def test_head_trickling_past_the_limit_gets_431_before_it_ends(srv: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nX-Big: ")
        with contextlib.suppress(OSError):  # the server may close while we still send
            for _ in range(40):
                sock.sendall(b"a" * 1024)
                time.sleep(0.005)
        assert recv_until_closed(sock).startswith(b"HTTP/1.1 431")


def test_a_body_does_not_count_toward_the_next_pipelined_head(srv: ServerThread) -> None:
    parts = [b"POST /e HTTP/1.1\r\nHost: x\r\nContent-",  # each part is one read
             b"Length: 20000\r\n\r\n" + b"x" * 20_000 + b"GET /ok HTTP/1.1\r\nHo",
             b"st: x\r\nConnection: close\r\n\r\n"]
    with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
        for part in parts:
            sock.sendall(part)
            time.sleep(0.1)
        out = recv_until_closed(sock)
    assert out.count(b"HTTP/1.1 200 OK") == 2, out[:200]


def test_upgrade_requests_are_answered_as_http11_then_closed(srv: ServerThread) -> None:
    h2c = (b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
           b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n")
    out = raw(srv.port, h2c + b"GET /never HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200") and b"connection: close" in out
    with_body = (b"POST /x HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: foo\r\n"
                 b"Content-Length: 3\r\n\r\nabc")
    assert raw(srv.port, with_body).startswith(b"HTTP/1.1 400")
    assert srv.server.handler.seen == ["/x"]  # type: ignore[attr-defined]


def test_http2_preface_gets_goaway_and_server_survives(srv: ServerThread) -> None:
    out = raw(srv.port, H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    assert out[3] == 0x04 and out[12] == 0x07  # SETTINGS, then GOAWAY
    assert out[-4:] == b"\x00\x00\x00\x0d"  # HTTP_1_1_REQUIRED
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def test_half_sent_head_then_close_does_not_crash(srv: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nContent-Le")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def _slow_server() -> ServerThread:
    return ServerThread(Handler(), ServerConfig(port=0, read_timeout_s=0.3, keep_alive_s=0.3))


@pytest.mark.parametrize("sent", [
    b"POST /x HTTP/1.1\r\nContent-Length: 100\r\n\r\nonly-part",  # stalled body
    b"GET /x HTTP/1.1\r\nHost: x\r\nX-Slow: ",  # stalled head (slowloris)
], ids=["body", "head"])
def test_stalled_client_gets_408_and_close_within_the_read_timeout(sent: bytes) -> None:
    with _slow_server() as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
            sock.sendall(sent)
            t0 = time.monotonic()
            assert recv_until_closed(sock).startswith(b"HTTP/1.1 408")
            assert time.monotonic() - t0 < 2.0
        assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


def test_idle_connection_is_closed_after_the_keep_alive_time() -> None:
    with _slow_server() as srv:
        for first in (b"", b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"):  # never asks / asked once
            with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
                sock.sendall(first)
                t0 = time.monotonic()
                out = recv_until_closed(sock)
                assert time.monotonic() - t0 < 2.0
                assert out == b"" if not first else out.startswith(b"HTTP/1.1 200")


def test_random_garbage_connections_leave_the_server_serving(srv: ServerThread) -> None:
    rng = random.Random(7)
    for _ in range(30):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        with socket.create_connection(("127.0.0.1", srv.port), timeout=3) as sock:
            sock.sendall(junk + b"\r\n\r\n")
            with contextlib.suppress(OSError):
                sock.recv(1000)
    assert httpx.get(srv.url + "/ok", timeout=5).status_code == 200


class _Transport:
    """Enough of an asyncio transport for the protocol: records writes and the close."""

    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name in ("peername", "sockname") else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


PREFIXES = [b"", b"GET / HTTP/1.1\r\n", b"POST /e HTTP/1.1\r\nContent-Length: 3\r\n",
            b"POST /e HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", H2_PREFACE[:10]]


@settings(max_examples=examples(300), deadline=None)
@given(st.sampled_from(PREFIXES), st.binary(max_size=300), st.integers(1, 64))
def test_protocol_answers_any_bytes_with_4xx_or_a_request(
    prefix: bytes, junk: bytes, cut: int
) -> None:
    data = prefix + junk
    async def main() -> tuple[bytes, int]:
        config = uvicorn.Config(AsgiApp(Handler()), log_config=None, lifespan="off", ws="none",
                                proxy_headers=False)
        config.load()
        state = ServerState()
        proto = limited_protocol(1024, 5.0)(config, state, {}, asyncio.get_running_loop())
        transport = _Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        for start in range(0, len(data), cut):
            if not transport.closed:
                proto.data_received(data[start:start + cut])
        tasks = list(state.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proto.connection_lost(None)
        assert not transport.out or transport.closed  # every refusal closes the link
        return transport.out

    out = asyncio.run(main())
    assert out == b"" or out.startswith((b"HTTP/1.1 4", b"\x00\x00\x00\x04")), out[:80]
