"""SGLang bootstrap client: the server-info checks against the golden answers of SGLang 0.5.23's
bootstrap server (tests/data/sglang_frames/*.http.json), and the calls and the protocol probe
against a tiny stdlib HTTP server, a raw ZMQ socket (a native peer), a closed port and raw TCP
servers that misbehave as dying or foreign ones do: only a ZMTP greeting is a native peer.
Ports 18390-18392 (the raw servers take free ones)."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import zmq

from decode_worker.errors import IncompatiblePeer, ProtocolError
from decode_worker.io.kv.protocol import ModelCompat
from decode_worker.io.kv.sglang import bootstrap_client as bc
from decode_worker.io.kv.sglang.server_info import (
    check_server_info,
    parse_rank_endpoint,
    parse_server_info,
    prefill_dp_rank,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "sglang_frames"
HTTP_PORT, ZMQ_PORT, CLOSED_PORT = 18390, 18391, 18392
COMPAT = ModelCompat("m", "bfloat16", ["swa", "full", "swa", "full"], 2, 16, 16, 127)


def golden(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.http.json").read_text())  # type: ignore[no-any-return]


def info_with(**changes: Any) -> Any:
    return dataclasses.replace(parse_server_info(golden("route_server_info")["body"]), **changes)


def test_golden_server_info_parses_and_passes() -> None:
    info = parse_server_info(golden("route_server_info")["body"])
    assert (info.attn_tp_size, info.dp_size, info.pp_size, info.page_size) == (1, 1, 1, 16)
    assert info.kv_cache_dtype == "auto" and info.kv_layout is None and info.follow_bootstrap_room
    check_server_info(info, COMPAT)
    tp2 = parse_server_info(golden("tp2_route_server_info")["body"])
    assert tp2.attn_tp_size == 2
    check_server_info(tp2, COMPAT)
    ep = parse_rank_endpoint(golden("route_rank")["body"], 0, 0)
    assert (ep.ip, ep.port) == ("127.0.0.1", 18238)


@pytest.mark.parametrize("changes, words", [
    ({"page_size": 32}, ["page_size=32", "16", "--page-size", "cache.page_size"]),
    ({"page_size": None}, ["page_size=None"]),
    ({"kv_cache_dtype": "fp8_e4m3"}, ["fp8_e4m3", "bfloat16", "--kv-cache-dtype"]),
    ({"kv_layout": "page_major"}, ["kv_layout='page_major'", "NHD"]),
    ({"pp_size": 2}, ["pp_size=2", "--pp-size"]),
    ({"dp_size": 2, "follow_bootstrap_room": False}, ["dp_size=2", "--load-balance-method"]),
    ({"attn_tp_size": 4}, ["attn_tp_size=4", "2 KV heads"]),
    ({"decode_allocation_policy": "prefill_complete"}, ["prefill_complete", "early"]),
])  # fmt: skip
def test_incompatible_prefills_are_refused_naming_both_values_and_the_flag(
    changes: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(IncompatiblePeer) as err:
        check_server_info(info_with(**changes), COMPAT)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_compatible_variants_pass() -> None:
    for changes in ({"page_size": 8}, {"page_size": 1}, {"kv_cache_dtype": "bf16"},
                    {"kv_cache_dtype": "bfloat16"}, {"attn_tp_size": 2}):
        check_server_info(info_with(**changes), COMPAT)
    dp = info_with(dp_size=4, follow_bootstrap_room=True)
    check_server_info(dp, COMPAT)
    assert prefill_dp_rank(dp, 4_000_000_006) == 2


@pytest.mark.parametrize("body", [[], "x", {"attn_tp_size": "2"}, {"dp_size": 1},
                                  {"attn_tp_size": 1, "page_size": True}])
def test_malformed_server_info_is_a_protocol_error(body: Any) -> None:
    with pytest.raises(ProtocolError):
        parse_server_info(body)


# -- calls against live sockets -----------------------------------------------------------------

class FakeBootstrap:
    """Answers GET path -> (status, JSON-able body or text) from `routes`."""

    def __init__(self, port: int) -> None:
        self.routes: dict[str, tuple[int, Any]] = {}
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                status, body = routes.get(self.path, (404, "no such route"))
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake() -> Iterator[FakeBootstrap]:
    server = FakeBootstrap(HTTP_PORT)
    yield server
    server.close()


@pytest.fixture
def zmq_router() -> Iterator[None]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{ZMQ_PORT}")
    yield
    sock.close()
    ctx.term()


def test_probe_finds_sglang_with_its_server_info(fake: FakeBootstrap) -> None:
    fake.routes[bc.SERVER_INFO_PATH] = (200, golden("tp2_route_server_info")["body"])
    found = bc.probe("127.0.0.1", HTTP_PORT, 2.0)
    assert found.kind == "sglang" and found.info is not None and found.info.attn_tp_size == 2


def test_a_probe_asks_a_503_again_until_its_deadline(fake: FakeBootstrap) -> None:
    """SGLang's ranks still registering: the probe asks again; the server info once they
    are in is the answer; a 503 until the deadline is no answer."""
    fake.routes[bc.SERVER_INFO_PATH] = (503, golden("route_not_ready")["body"])
    assert bc.fetch_server_info("127.0.0.1", HTTP_PORT, 2.0) is None
    start = time.monotonic()
    found = bc.probe("127.0.0.1", HTTP_PORT, 0.5)
    assert found.kind == "unreachable" and "503" in found.detail, found
    assert 0.4 < time.monotonic() - start < 1.5
    timer = threading.Timer(0.3, fake.routes.__setitem__, (
        bc.SERVER_INFO_PATH, (200, golden("route_server_info")["body"])))
    timer.start()
    found = bc.probe("127.0.0.1", HTTP_PORT, 2.0)
    timer.join()
    assert found.kind == "sglang" and found.info is not None and found.info.page_size == 16


def test_probe_finds_a_native_peer_at_once(zmq_router: None) -> None:
    start = time.monotonic()
    assert bc.probe("127.0.0.1", ZMQ_PORT, 5.0).kind == "native"
    assert time.monotonic() - start < 1.0  # the ZMTP greeting, not the timeout
    with pytest.raises(bc.NotHttp):
        bc.check_health("127.0.0.1", ZMQ_PORT, 5.0)


def test_probe_of_a_closed_port_is_unreachable_and_definite() -> None:
    found = bc.probe("127.0.0.1", CLOSED_PORT, 2.0)
    assert found.kind == "unreachable" and "refused" in found.detail
    with pytest.raises(bc.PeerUnreachable) as err:
        bc.check_health("127.0.0.1", CLOSED_PORT, 2.0)
    assert err.value.definite


def test_probe_of_another_http_server_is_foreign(fake: FakeBootstrap) -> None:
    found = bc.probe("127.0.0.1", HTTP_PORT, 2.0)
    assert found.kind == "foreign" and "404" in found.detail


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_5xx_other_than_503_is_no_answer(fake: FakeBootstrap, status: int) -> None:
    """A proxy with nothing behind it, or a failing server: unreachable, not foreign."""
    fake.routes[bc.SERVER_INFO_PATH] = (status, "upstream gone")
    found = bc.probe("127.0.0.1", HTTP_PORT, 2.0)
    assert found.kind == "unreachable" and str(status) in found.detail
    fake.routes[bc.HEALTH_PATH] = (status, "boom")
    with pytest.raises(bc.PeerUnreachable) as err:
        bc.check_health("127.0.0.1", HTTP_PORT, 2.0)
    assert not err.value.definite


class RawServer:
    """A TCP listener on a free port whose every connection gets `behaviour`: "close" (FIN
    before a byte), "reset" (RST), "garbage" (non-HTTP bytes), "silent" (reads, says nothing)."""

    def __init__(self, behaviour: str) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.behaviour, self.held = behaviour, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(4096)
            if self.behaviour == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif self.behaviour == "garbage":
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            if self.behaviour == "silent":
                self.held.append(conn)
            else:
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize(("behaviour", "kind", "words"), [
    ("close", "unreachable", "without answering"),
    ("reset", "unreachable", "connection lost"),
    ("silent", "unreachable", "no answer within"),
    ("garbage", "foreign", "instead of HTTP"),
])  # fmt: skip
def test_a_dying_or_foreign_server_is_never_taken_for_a_native_peer(
        behaviour: str, kind: str, words: str) -> None:
    server = RawServer(behaviour)
    try:
        start = time.monotonic()
        found = bc.probe("127.0.0.1", server.port, 0.5)
        took = time.monotonic() - start
    finally:
        server.close()
    assert (found.kind, words in found.detail) == (kind, True), found
    assert took < 1.0  # within about the probe's timeout, even for a silent one


def test_rank_endpoints_and_health(fake: FakeBootstrap) -> None:
    path = ("/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1"
            "&target_pp_rank=0")  # fmt: skip
    fake.routes[path] = (200, golden("tp2_route_rank1")["body"])
    ep = bc.fetch_rank_endpoint("127.0.0.1", HTTP_PORT, 0, 1, 2.0)
    assert ep is not None and (ep.tp_rank, ep.port) == (1, 18249)
    with pytest.raises(ProtocolError, match="404"):
        bc.fetch_rank_endpoint("127.0.0.1", HTTP_PORT, 0, 7, 2.0)
    fake.routes[bc.HEALTH_PATH] = (200, "OK")
    bc.check_health("127.0.0.1", HTTP_PORT, 2.0)
    fake.routes[bc.HEALTH_PATH] = (404, "no")
    with pytest.raises(ProtocolError, match="404"):
        bc.check_health("127.0.0.1", HTTP_PORT, 2.0)
    assert bc.local_ip_toward("127.0.0.1", HTTP_PORT) == "127.0.0.1"
