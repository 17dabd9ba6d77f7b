"""Our SGLang bootstrap server answers byte for byte as SGLang 0.5.23's `CommonKVBootstrapServer`
did in the captured exchanges (tests/data/sglang_frames/*.http.json): the table itself, and the
live HTTP server on loopback (ports 18490-18499)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from decode_worker.daemon.prefill.sglang_peer import rank_registration
from decode_worker.errors import TransferError
from decode_worker.io.kv.sglang.bootstrap_server import BootstrapHttpServer, BootstrapTable, Reply

DATA = Path(__file__).resolve().parents[2] / "data" / "sglang_frames"
PORT = 18490
TEXT, JSON = "text/plain; charset=utf-8", "application/json; charset=utf-8"


def golden(name: str) -> dict[str, Any]:
    return dict(json.loads((DATA / f"{name}.http.json").read_text()))


def expected(doc: dict[str, Any]) -> tuple[int, bytes, str]:
    """(status, body bytes, content type) as aiohttp sent them: `json.dumps` or the text."""
    body = doc["body"]
    if isinstance(body, str):
        return doc["status"], body.encode(), TEXT
    return doc["status"], json.dumps(body).encode(), JSON


def ask(table: BootstrapTable, doc: dict[str, Any]) -> tuple[int, bytes, str]:
    url = urlsplit(doc["path"])
    reply = table.handle(doc["method"], url.path, parse_qs(url.query, keep_blank_values=True),
                         doc["request_json"])  # fmt: skip
    return reply.status, reply.body, reply.content_type


def registered(tp_size: int = 1) -> BootstrapTable:
    """A table with every rank of the captured prefill registered (its PUT bodies)."""
    table, put = BootstrapTable(), golden("route_put")["request_json"]
    for rank in range(tp_size):
        port = golden("tp2_route_rank1")["body"]["rank_port"] if rank else put["rank_port"]
        reply = table.put_route({**put, "attn_tp_size": tp_size, "attn_tp_rank": rank,
                                 "rank_port": port})  # fmt: skip
        assert (reply.status, reply.body) == (200, b"OK")
    return table


@pytest.mark.parametrize("name", ["route_server_info", "route_rank", "route_unknown_rank",
                                  "route_missing_query", "health"])
def test_registered_server_answers_as_sglang(name: str) -> None:
    doc = golden(name)
    assert ask(registered(), doc) == expected(doc)


def test_put_route_answers_ok() -> None:
    doc = golden("route_put")
    assert ask(BootstrapTable(), doc) == expected(doc)


def test_not_ready_until_every_rank_registered() -> None:
    doc = golden("route_not_ready")
    assert ask(BootstrapTable(), doc) == expected(doc)
    table, put = BootstrapTable(), golden("route_put")["request_json"]
    table.put_route({**put, "attn_tp_size": 2})
    status, body, _ = ask(table, doc)
    assert (status, body) == (503, b"Prefill server not fully registered yet (1 workers "
                                   b"registered).")  # fmt: skip
    rank = {**doc, "path": golden("route_rank")["path"]}
    assert ask(table, rank)[0] == 503


@pytest.mark.parametrize("name", ["tp2_route_server_info", "tp2_route_rank1"])
def test_two_rank_prefill_answers_as_sglang(name: str) -> None:
    doc = golden(name)
    assert ask(registered(tp_size=2), doc) == expected(doc)


def test_our_rank_registration_is_sglangs_put_body() -> None:
    """The body our prefill registers its rank with: SGLang's keys in SGLang's order."""
    put = golden("route_put")["request_json"]
    ours = rank_registration("127.0.0.1", put["rank_port"], 16, 30000)
    assert list(ours) == list(put) and ours == put
    table = BootstrapTable()
    table.put_route(ours)
    assert ask(table, golden("route_server_info")) == expected(golden("route_server_info"))


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("PUT", "/route", {"attn_tp_size": 1}, 400),
    ("PUT", "/route", [1, 2], 400),
    ("GET", "/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
     None, 400),
    ("DELETE", "/route", None, 405),
    ("POST", "/health", None, 405),
    ("GET", "/nowhere", None, 404),
    ("POST", "/query_dp_ranks", {"nope": 1}, 400),
])
def test_bad_requests_get_4xx_with_a_reason(method: str, path: str, body: Any,
                                            status: int) -> None:
    doc = {"method": method, "path": path, "request_json": body}
    got, text, _ = ask(registered(), doc)
    assert got == status and text


def test_query_dp_ranks_knows_no_room_with_one_dp_rank() -> None:
    doc = {"method": "POST", "path": "/query_dp_ranks", "request_json": {"bootstrap_rooms": [5]}}
    assert ask(registered(), doc) == (200, b"{}", JSON)


@pytest.fixture()
def server() -> Iterator[BootstrapHttpServer]:
    srv = BootstrapHttpServer("127.0.0.1", PORT, registered())
    yield srv
    srv.close()


def test_live_server_answers_byte_for_byte_on_one_connection(
        server: BootstrapHttpServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for name in ("route_server_info", "route_rank", "route_unknown_rank",
                     "route_missing_query", "health", "route_put"):
            doc = golden(name)
            body = None if doc["request_json"] is None else json.dumps(doc["request_json"])
            conn.request(doc["method"], doc["path"], body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()  # keep-alive: the same connection for every exchange
            got = (resp.status, resp.read(), resp.getheader("Content-Type"))
            assert got == expected(doc), name
    finally:
        conn.close()


def test_live_server_rejects_a_body_that_is_not_json(server: BootstrapHttpServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("PUT", "/route", body=b"{not json")
        resp = conn.getresponse()
        assert resp.status == 400 and resp.read() == b"expected a JSON body"
    finally:
        conn.close()


def test_busy_port_is_a_transfer_error(server: BootstrapHttpServer) -> None:
    with pytest.raises(TransferError, match=f"cannot bind 127.0.0.1:{PORT}"):
        BootstrapHttpServer("127.0.0.1", PORT, BootstrapTable())


def test_reply_is_plain_data() -> None:
    assert Reply(200, b"OK", TEXT) == Reply(200, b"OK", TEXT)
