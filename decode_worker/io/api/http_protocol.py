"""uvicorn's httptools protocol with the limits it lacks: head size, head time, HTTP/2 probes.

uvicorn bounds neither the size of a request head (httptools buffers a header of any length)
nor the time a client may take to send it (its keep-alive timer runs only between requests).
`LimitedHttpToolsProtocol` adds, per connection:
- the head (request line and header fields) at most `max_head_bytes` and `MAX_HEADER_FIELDS`
  fields: else 431 and close. A complete head is measured exactly (url + fields); one still
  arriving is measured by the reads after the one it began in, so memory stays bounded by
  `max_head_bytes` plus one read;
- a head must arrive within `head_timeout_s` of its first byte, a first request within the
  keep-alive time of the connect: else 408 (head) or a plain close (idle);
- an HTTP/2 connection preface (the router's gRPC-style probes) gets an HTTP/2 SETTINGS +
  GOAWAY(HTTP_1_1_REQUIRED) and a close, as an HTTP/2 peer must see to give up cleanly;
- requests httptools refuses (bad framing, bare LF, CR without LF, obs-fold, bad tokens,
  Content-Length with Transfer-Encoding, ...) get a JSON 400 instead of uvicorn's text one;
- nothing is upgraded (no websockets, no h2c): a request asking for an upgrade (or CONNECT) is
  answered as HTTP/1.1 and the connection then closes; one that also has a body gets 400.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from decode_worker.io.api.message import error_body

log = logging.getLogger(__name__)

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# SETTINGS (empty) then GOAWAY(last stream 0, HTTP_1_1_REQUIRED = 0xd) (RFC 9113 3.4, 7).
H2_GOAWAY = bytes.fromhex("000000040000000000" "000008070000000000" "00000000" "0000000d")
MAX_HEADER_FIELDS = 100


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; the status is in `_refusal`."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """One connection. Limits are class attributes: use `limited_protocol(...)` for a class."""

    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = False
        self._head_bytes = 0
        self._num_fields = 0
        self._num_heads = 0
        self._began = False  # a head began in the read being parsed
        self._upgraded = False  # httptools stopped at an Upgrade: nothing more is parsed
        self._refusal: tuple[int, str] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        # the first request must come within the keep-alive time, like any later one
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._num_heads == 0 and not self._in_head and data.startswith(H2_PREFACE[:14]):
            self._unset_keepalive_if_required()
            self.transport.write(H2_GOAWAY)
            self.transport.close()
            return
        self._unset_keepalive_if_required()
        if self._upgraded:
            return
        counted, self._began = self._in_head, False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # no upgrades here: answered, then closed
            self._upgraded = True
            if self.cycle is not None and self.cycle.response_complete:
                self.transport.close()
        except httptools.HttpParserError as exc:
            self._refuse(*(self._refusal or (400, f"malformed HTTP request: {exc}")))
            return
        # a head still open, begun in an earlier read: count this read whole (the read a head
        # begins in is measured by the url and field callbacks)
        if counted and self._in_head and not self._began and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, f"request head larger than {self.max_head_bytes} bytes")

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._began, self._head_bytes, self._num_fields = True, True, 0, 0
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_fields += 1
        if self._num_fields > MAX_HEADER_FIELDS:
            self._refusal = (431, f"more than {MAX_HEADER_FIELDS} header fields")
            raise _Refused
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._num_heads += 1
        self._cancel_head_timer()
        upgrade = self.parser.should_upgrade()  # Upgrade (h2c, websocket) or CONNECT
        if upgrade and any(name in (b"content-length", b"transfer-encoding") and value != b"0"
                           for name, value in self.headers):
            self._refusal = (400, "a request asking for a protocol upgrade must have no body")
            raise _Refused  # httptools would hand its body to the upgraded protocol
        super().on_headers_complete()
        if upgrade:  # served as plain HTTP/1.1; httptools parses no more of this connection
            self.cycle.keep_alive = False

    # -- answers -----------------------------------------------------------------------------

    def _count(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > self.max_head_bytes:
            self._refusal = (431, f"request head larger than {self.max_head_bytes} bytes")
            raise _Refused

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with a JSON error and close; only closes if a response is under way."""
        self._cancel_head_timer()
        self._in_head = False
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            log.info("http %s: %d %s", _peer(self.client), status, message)
            self.transport.write(_simple_response(status, message, self.server_state))
        self.transport.close()

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head waits behind a request still answered: time it after that one
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)
            return
        self._refuse(408, f"request head not received within {self.head_timeout_s:g}s")

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def limited_protocol(max_head_bytes: int, head_timeout_s: float) -> type[LimitedHttpToolsProtocol]:
    """A protocol class with these limits (uvicorn's `Config(http=...)` takes a class)."""

    class Protocol(LimitedHttpToolsProtocol):
        pass

    Protocol.max_head_bytes = max_head_bytes
    Protocol.head_timeout_s = head_timeout_s
    return Protocol


def _simple_response(status: int, message: str, server_state: Any) -> bytes:
    body = error_body(status, message)
    lines = [STATUS_LINE[status]]
    lines += [name + b": " + value + b"\r\n" for name, value in server_state.default_headers]
    lines.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
    lines.append(b"connection: close\r\n\r\n")
    return b"".join(lines) + body


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
