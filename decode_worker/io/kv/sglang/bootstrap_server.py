"""SGLang 0.5.23's bootstrap HTTP server (prefill side), answering as `CommonKVBootstrapServer`.

A decode side reads it (docs/PROTOCOLS.md, "Bootstrap server"); each prefill rank
registers its ZMQ PULL address with `PUT /route` (ours in-process: `BootstrapTable.put_route`):

    PUT  /route                  rank registration (JSON)           200 "OK"
    GET  /route?...=-1 (x4)      PrefillServerInfo (JSON)           503 until every rank registered
    GET  /route?dp&cp&tp&pp      {"rank_ip", "rank_port"}           404 unknown rank, 400 bad query
    POST /query_dp_ranks         {"bootstrap_rooms": [...]}         {} (dp size 1: no room known)
    GET  /health                 liveness                           200 "OK"

Bodies are byte-identical to SGLang's (aiohttp `json_response` = `json.dumps`, text as UTF-8;
tests/data/sglang_frames/*.http.json). Served by the stdlib `ThreadingHTTPServer` on its own
thread: the bootstrap port is a listener of its own (the router hands it to the decode), /health
then answers whatever the prefill's event loop is doing, and io stays free of a second ASGI app.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from decode_worker.errors import TransferError

log = logging.getLogger(__name__)
_ROUTE_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_PUT_KEYS = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size",
             "attn_dp_rank", "pp_size", "pp_rank", "system_dp_size", "system_dp_rank",
             "rank_ip", "rank_port", "page_size", "kv_cache_dtype")
_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str


def text_reply(status: int, text: str, content_type: str = "text/plain") -> Reply:
    return Reply(status, text.encode(), f"{content_type}; charset=utf-8")


def json_reply(obj: Any) -> Reply:
    return Reply(200, json.dumps(obj).encode(), "application/json; charset=utf-8")


class BootstrapTable:
    """The server's state (ranks, topology, room -> dp rank) and its answers. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._topology: dict[str, Any] = {}  # first registration's sizes and flags
        self._ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}  # (dp, cp, tp, pp)

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Reply:
        """One request's answer (aiohttp's texts for unknown paths and methods)."""
        if path == "/route":
            if method in ("GET", "PUT"):
                return self.get_route(query) if method == "GET" else self.put_route(body)
            return text_reply(405, "Method not allowed", "application/json")
        wanted = {"/health": "GET", "/query_dp_ranks": "POST"}
        if path not in wanted:
            return text_reply(404, "404: Not Found")
        if method != wanted[path]:
            return text_reply(405, "405: Method Not Allowed")
        return text_reply(200, "OK") if path == "/health" else self.query_dp_ranks(body)

    def put_route(self, data: Any) -> Reply:
        """A rank's registration (SGLang's PUT body); 400 names a missing or bad key."""
        if not isinstance(data, dict):
            return text_reply(400, "PUT /route: expected a JSON object")
        missing = [k for k in _PUT_KEYS if k not in data]
        if missing:
            return text_reply(400, f"PUT /route: missing keys {missing}")
        policy = data.get("decode_allocation_policy", "early")
        with self._lock:
            if self._ranks and self._topology["dsv41_spec_layout"] != data.get("dsv41_spec_layout"):
                return text_reply(400, "DeepSeek-V4.1 DSpark PD layout differs across prefill "
                                  "ranks")  # fmt: skip
            if self._ranks and self._topology["decode_allocation_policy"] != policy:
                return text_reply(400, "Inconsistent prefill allocation policies")
            try:
                key, info = self._rank_entry(data)
                topology = self._topology or _topology(data, policy)
            except (TypeError, ValueError) as exc:
                return text_reply(400, f"PUT /route: {exc}")
            self._topology = topology
            self._ranks[key] = info
        log.info("bootstrap: rank dp%d cp%d tp%d pp%d at %s:%d", *key, info["rank_ip"],
                 info["rank_port"])  # fmt: skip
        return text_reply(200, "OK")

    @staticmethod
    def _rank_entry(data: dict[str, Any]) -> tuple[tuple[int, int, int, int], dict[str, Any]]:
        dp = int(data["attn_dp_rank"] if int(data["system_dp_size"]) == 1
                 else data["system_dp_rank"])  # fmt: skip
        key = (dp, int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
        return key, {"rank_ip": str(data["rank_ip"]), "rank_port": int(data["rank_port"])}

    def _ready_locked(self) -> bool:
        """Every dp*cp*tp*pp rank of the first registration's topology has registered."""
        t = self._topology
        if not t:
            return False
        return len(self._ranks) >= t["dp_size"] * t["attn_cp_size"] * t["attn_tp_size"] * t[
            "pp_size"]

    def get_route(self, query: dict[str, list[str]]) -> Reply:
        """Server info (all four ranks -1) or one rank's PULL address."""
        values = [(query.get(k) or [""])[0] for k in _ROUTE_KEYS]
        if not all(values):
            return text_reply(400, "Missing inputs for bootstrap server.")
        try:
            dp, cp, tp, pp = (int(v) for v in values)
        except ValueError:
            return text_reply(400, f"Bad inputs for bootstrap server: {values}")
        with self._lock:
            if not self._ready_locked():
                return text_reply(503, "Prefill server not fully registered yet "
                                  f"({len(self._ranks)} workers registered).")  # fmt: skip
            if (dp, cp, tp, pp) == (-1, -1, -1, -1):
                return json_reply(_server_info(self._topology))
            info = self._ranks.get((dp, cp, tp, pp))
        if info is None:
            v = values
            return text_reply(404, f"Bootstrap info not found for dp_rank={v[0]} cp_rank={v[1]} "
                              f"tp_rank={v[2]} pp_rank={v[3]}")  # fmt: skip
        return json_reply(info)

    def query_dp_ranks(self, data: Any) -> Reply:
        """Rooms' dp ranks, known rooms only: none here (dp size 1, nothing registers rooms)."""
        try:
            [int(r) for r in data["bootstrap_rooms"]]
        except (TypeError, KeyError, ValueError) as exc:
            return text_reply(400, f"POST /query_dp_ranks: bad body ({exc!r})")
        return json_reply({})


def _topology(data: dict[str, Any], policy: str) -> dict[str, Any]:
    """What the first registration fixes (SGLang keeps the first value of each)."""
    return {
        "attn_tp_size": int(data["attn_tp_size"]), "attn_cp_size": int(data["attn_cp_size"]),
        "dp_size": int(data["attn_dp_size"] if int(data["system_dp_size"]) == 1
                       else data["system_dp_size"]),
        "pp_size": int(data["pp_size"]), "page_size": int(data["page_size"]),
        "kv_cache_dtype": data["kv_cache_dtype"], "kv_layout": data.get("kv_layout"),
        "dsv41_spec_layout": data.get("dsv41_spec_layout"),
        "follow_bootstrap_room":
            data.get("load_balance_method", "follow_bootstrap_room") == "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": bool(data.get("enable_dsa_cache_layer_split", False)),
        "enable_kv_cache_sharding": bool(data.get("enable_kv_cache_sharding", False)),
        "prefill_http_port": (None if data.get("prefill_http_port") is None
                              else int(data["prefill_http_port"])),
        "decode_allocation_policy": policy,
    }  # fmt: skip


def _server_info(t: dict[str, Any]) -> dict[str, Any]:
    """`dataclasses.asdict(PrefillServerInfo)`, in its field order; `dsv41_spec_layout` and
    `kv_layout` only when set; the decode-side mapping fields as null."""
    info: dict[str, Any] = {k: t[k] for k in ("attn_tp_size", "attn_cp_size", "dp_size",
                                              "pp_size", "page_size", "kv_cache_dtype",
                                              "follow_bootstrap_room",
                                              "enable_dsa_cache_layer_split")}
    for key in ("dsv41_spec_layout", "kv_layout"):
        if t[key] is not None:
            info[key] = t[key]
    info.update({k: t[k] for k in ("decode_allocation_policy", "enable_kv_cache_sharding",
                                   "prefill_http_port")})
    info.update(dict.fromkeys(("target_tp_rank", "target_tp_ranks", "target_cp_ranks",
                               "target_pp_ranks", "required_dst_info_num",
                               "required_prefill_response_num")))
    return info


class BootstrapHttpServer:
    """Serve `table` on http://host:port from a daemon thread until `close()`.

    Raises TransferError if the port cannot be bound.
    """

    def __init__(self, host: str, port: int, table: BootstrapTable) -> None:
        self.table = table
        server_cls = _V6Server if ":" in host else _V4Server
        try:
            self._server = server_cls((host, port), _Handler)
        except OSError as exc:
            raise TransferError(f"SGLang bootstrap server cannot bind {host}:{port}: {exc}"
                                ) from None  # fmt: skip
        self._server.table = table
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.2,),
                                        name="sglang-bootstrap-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _V4Server(ThreadingHTTPServer):
    daemon_threads = True
    table: BootstrapTable


class _V6Server(_V4Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: SGLang's decode reuses its connections
    server: _V4Server

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        body = self._json_body()
        reply = body if isinstance(body, Reply) else self.server.table.handle(
            self.command, url.path, parse_qs(url.query, keep_blank_values=True), body)
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)

    do_PUT = do_POST = do_DELETE = do_PATCH = do_GET

    def _json_body(self) -> Any:
        """The request's JSON body (None without one), or a 400/413 Reply."""
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY_BYTES:
            self.close_connection = True
            return text_reply(413, f"body of {length} bytes is over {_MAX_BODY_BYTES}")
        if length <= 0:
            return None
        try:
            return json.loads(self.rfile.read(length))
        except (ValueError, UnicodeDecodeError):
            return text_reply(400, "expected a JSON body")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("bootstrap http %s: " + format, self.client_address[0], *args)
