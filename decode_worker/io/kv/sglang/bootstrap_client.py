"""Blocking HTTP calls to an SGLang prefill's bootstrap server (stdlib only).

Every call here blocks for up to `timeout_s`: run them off the compute thread (the receiver and
the router own a small thread pool and poll the futures). The server (SGLang's aiohttp
`CommonKVBootstrapServer`) answers:

    GET /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1
        200 PrefillServerInfo JSON | 503 while its ranks register
    GET /route?prefill_dp_rank=d&prefill_cp_rank=0&target_tp_rank=t&target_pp_rank=0
        200 {"rank_ip", "rank_port"} | 404 unknown rank | 503 not ready
    GET /health
        200 "OK"

A decode worker's own (native) bootstrap port is a ZMQ ROUTER socket: it answers a connection
with ZMTP's greeting (first byte 0xFF) and then waits forever, so every call peeks at the first
bytes of the answer and raises `NotHttp` at once instead of waiting for a status line.

What counts as no answer (`PeerUnreachable`), never as a native peer: refused, unresolvable,
reset, closed before a byte came (a server being killed accepts and then drops connections),
silent until the timeout, a 5xx other than SGLang's 503 (a proxy with nothing behind it).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Literal

from decode_worker.errors import ProtocolError, TransferError
from decode_worker.io.kv.sglang.server_info import (
    PrefillServerInfo,
    RankEndpoint,
    parse_rank_endpoint,
    parse_server_info,
)

SERVER_INFO_PATH = ("/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                    "&target_pp_rank=-1")  # fmt: skip
HEALTH_PATH = "/health"
ZMTP_SIGNATURE = b"\xff"  # the first byte of every ZMTP 3 greeting (what a ZMQ socket says first)
_RETRY_503_S = 0.1  # a probe that meets a 503 (SGLang's ranks registering) asks again this often


class PeerUnreachable(TransferError):
    """No answer: refused, unresolvable, reset or closed unanswered (`definite`), silent until
    the timeout, or a 5xx other than 503 (not definite)."""

    def __init__(self, message: str, definite: bool) -> None:
        super().__init__(message)
        self.definite = definite


class NotHttp(TransferError):
    """The port answered, but not in HTTP; `zmtp`: with a ZMTP greeting (a ZMQ socket: a native
    decode-worker peer), else with other bytes."""

    def __init__(self, message: str, zmtp: bool) -> None:
        super().__init__(message)
        self.zmtp = zmtp


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    status: int
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")[:200]


@dataclass(frozen=True, slots=True)
class Probe:
    """What listens on a bootstrap address: "sglang" (with its server info), "native" (a ZMQ
    socket), "unreachable" (no answer, see the module doc; or a 503 until the deadline), or
    "foreign" (an answer from neither); `detail` says why for the last two. `instant`: an
    "unreachable" seen at one moment of the probe (refused, unresolvable, reset, closed
    unanswered), not throughout it (silent until the timeout, 5xx until the deadline)."""

    kind: Literal["sglang", "native", "unreachable", "foreign"]
    info: PrefillServerInfo | None = None
    detail: str = ""
    instant: bool = False


def http_get(host: str, port: int, path: str, timeout_s: float) -> HttpAnswer:
    """One `GET path` (connection closed after), within about `timeout_s`. Raises
    PeerUnreachable (no answer, a reset, a 5xx other than 503) or NotHttp."""
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        try:
            conn.connect()
        except (ConnectionRefusedError, socket.gaierror) as exc:
            raise PeerUnreachable(f"{where}: {exc}", definite=True) from None
        except OSError as exc:  # timeout, no route
            raise PeerUnreachable(f"{where}: cannot connect: {exc}", definite=False) from None
        assert conn.sock is not None  # connected above (our own state, not peer input)
        conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn.request("GET", path, headers={"Connection": "close"})
            _expect_http(conn, where)
            resp = conn.getresponse()
            answer = HttpAnswer(resp.status, resp.read())
        except TimeoutError:
            raise PeerUnreachable(f"{where}: no answer within {timeout_s:.1f} s",
                                  definite=False) from None  # fmt: skip
        except ConnectionError as exc:  # reset, or closed mid-answer (before the HTTPException)
            raise PeerUnreachable(f"{where}: connection lost before an answer "
                                  f"({type(exc).__name__})", definite=True) from None
        except http.client.HTTPException as exc:
            raise NotHttp(f"{where}: not an HTTP answer ({type(exc).__name__})", False) from None
    finally:
        conn.close()
    if answer.status >= 500 and answer.status != 503:
        raise PeerUnreachable(f"{where}: answered {answer.status}: {answer.text()}",
                              definite=False)  # fmt: skip
    return answer


def _expect_http(conn: http.client.HTTPConnection, where: str) -> None:
    """Peek at the answer's first bytes: raises PeerUnreachable if the peer closed without a
    byte, NotHttp unless they begin "HTTP/"."""
    assert conn.sock is not None  # connected above (our own state, not peer input)
    head = conn.sock.recv(5, socket.MSG_PEEK)
    if not head:
        raise PeerUnreachable(f"{where}: closed the connection without answering", definite=True)
    if head.startswith(ZMTP_SIGNATURE):
        raise NotHttp(f"{where}: answered with a ZMTP greeting (a ZMQ socket)", zmtp=True)
    if not b"HTTP/".startswith(head):
        raise NotHttp(f"{where}: answered {head!r} instead of HTTP", zmtp=False)


def fetch_server_info(host: str, port: int, timeout_s: float) -> PrefillServerInfo | None:
    """The prefill's server info; None while its ranks register (503).

    Raises PeerUnreachable, NotHttp, or ProtocolError (another status, bad JSON)."""
    answer = http_get(host, port, SERVER_INFO_PATH, timeout_s)
    if answer.status == 503:
        return None
    return parse_server_info(_json(answer, f"{host}:{port} GET /route (server info)"))


def fetch_rank_endpoint(
    host: str, port: int, dp_rank: int, tp_rank: int, timeout_s: float
) -> RankEndpoint | None:
    """Where prefill rank (dp_rank, tp_rank) listens; None if not registered yet (503).
    Raises PeerUnreachable, NotHttp, or ProtocolError (404: no such rank)."""
    path = (f"/route?prefill_dp_rank={dp_rank}&prefill_cp_rank=0&target_tp_rank={tp_rank}"
            "&target_pp_rank=0")  # fmt: skip
    answer = http_get(host, port, path, timeout_s)
    if answer.status == 503:
        return None
    body = _json(answer, f"{host}:{port} GET /route (dp {dp_rank} tp {tp_rank})")
    return parse_rank_endpoint(body, dp_rank, tp_rank)


def check_health(host: str, port: int, timeout_s: float) -> None:
    """Raises PeerUnreachable, NotHttp, or ProtocolError unless `GET /health` answers 200."""
    answer = http_get(host, port, HEALTH_PATH, timeout_s)
    if answer.status != 200:
        raise ProtocolError(f"{host}:{port} GET /health answered {answer.status}: "
                            f"{answer.text()}")  # fmt: skip


def probe(host: str, port: int, timeout_s: float) -> Probe:
    """Which protocol the peer at host:port speaks (auto mode), within about `timeout_s` (a
    503 is asked again until then). Never raises TransferError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = http_get(host, port, SERVER_INFO_PATH, max(0.01, deadline - time.monotonic()))
        except NotHttp as exc:
            return Probe("native") if exc.zmtp else Probe("foreign", detail=str(exc))
        except PeerUnreachable as exc:
            return Probe("unreachable", detail=str(exc), instant=exc.definite)
        if answer.status != 503:
            break
        if time.monotonic() + _RETRY_503_S > deadline:
            return Probe("unreachable", detail=f"{host}:{port}: answered 503 for {timeout_s:.1f} "
                                               "s (its SGLang ranks are still registering)")
        time.sleep(_RETRY_503_S)
    try:
        return Probe("sglang", parse_server_info(_json(answer, f"{host}:{port} GET /route")))
    except ProtocolError as exc:
        return Probe("foreign", detail=f"answers HTTP but not as an SGLang bootstrap server: "
                                       f"{exc}")  # fmt: skip


def local_ip_toward(host: str, port: int) -> str:
    """The local address this host uses to reach host:port (no packet is sent).
    Raises PeerUnreachable if the name does not resolve or no route exists."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            return str(sock.getsockname()[0])
    except OSError as exc:
        raise PeerUnreachable(f"{host}:{port}: no local route: {exc}", definite=True) from None


def _json(answer: HttpAnswer, what: str) -> object:
    if answer.status != 200:
        raise ProtocolError(f"{what} answered {answer.status}: {answer.text()}")
    try:
        return json.loads(answer.body)
    except ValueError:
        raise ProtocolError(f"{what}: not JSON: {answer.text()!r}") from None
