"""HTTP/1.x request parsing over a buffered asyncio stream.

`Input` wraps a StreamReader with its own buffer so that two readers can share it in turn: the
server parses requests from it, and while a handler runs a watcher reads ahead to notice a
disconnect (EOF) without losing a pipelined next request.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from decode_worker.io.http.message import HttpError

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_READ = 65536


class ConnectionEnded(Exception):
    """The peer closed the connection (EOF) where more bytes were needed."""


class H2Preface(Exception):
    """The peer opened with the HTTP/2 connection preface (e.g. a gRPC health probe)."""


@dataclass(slots=True)
class Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]


class Input:
    """A StreamReader plus a read-ahead buffer. Only one coroutine may read at a time."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self.buf = bytearray()
        self.eof = False

    async def fill(self) -> bool:
        """Read what is available into the buffer; False (and `eof`) once the peer closed."""
        if self.eof:
            return False
        try:
            data = await self._reader.read(_READ)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def read_until(self, sep: bytes, limit: int, what: str) -> bytes:
        """Bytes before `sep` (consumed with it). HttpError 431/400 past `limit` bytes."""
        start = 0
        while True:
            idx = self.buf.find(sep, start)
            if idx > limit:
                raise HttpError(431 if what == "head" else 400, f"{what} too long")
            if idx >= 0:
                out = bytes(self.buf[:idx])
                del self.buf[: idx + len(sep)]
                return out
            if len(self.buf) > limit:
                raise HttpError(431 if what == "head" else 400, f"{what} too long")
            start = max(0, len(self.buf) - len(sep) + 1)
            if not await self.fill():
                raise ConnectionEnded(what)

    async def read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise ConnectionEnded("body")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


async def read_head(inp: Input, limit: int) -> Head:
    """Read and parse one request head. Raises ConnectionEnded on a clean EOF before any byte,
    H2Preface for an HTTP/2 client, HttpError for anything malformed."""
    while inp.buf[:2] == b"\r\n":  # tolerate stray CRLFs between requests (RFC 9112 2.2)
        del inp.buf[:2]
    if not inp.buf and not await inp.fill():
        raise ConnectionEnded("idle")
    if inp.buf[:3] == b"PRI" and H2_PREFACE.startswith(bytes(inp.buf[:24])):
        raise H2Preface
    raw = await inp.read_until(b"\r\n\r\n", limit, "head")
    return parse_head(raw)


def parse_head(raw: bytes) -> Head:
    """Parse a request line and header lines (without the final blank line); pure."""
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[1]:
        raise HttpError(400, "malformed request line")
    version = parts[2].decode("latin-1")
    if version == "HTTP/2.0":
        raise H2Preface
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, f"unsupported protocol version {version[:16]!r}")
    headers: dict[str, str] = {}
    if len(lines) > 101:
        raise HttpError(431, "too many header fields")
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):
            raise HttpError(400, "malformed header line")
        key = name.decode("latin-1").lower()
        val = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {val}" if key in headers else val
    return Head(parts[0].decode("latin-1"), parts[1].decode("latin-1"), version, headers)


def body_length(headers: dict[str, str]) -> int | None:
    """Content-Length, 0 if absent, or None for a chunked body. HttpError if they conflict."""
    te = headers.get("transfer-encoding")
    cl = headers.get("content-length")
    if te is not None:
        if cl is not None:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        if te.strip().lower() != "chunked":
            raise HttpError(501, f"transfer-encoding {te[:32]!r} not supported")
        return None
    if cl is None:
        return 0
    if not cl.isdigit() or len(cl) > 18:
        raise HttpError(400, "invalid Content-Length")
    return int(cl)


async def read_chunked(inp: Input, max_bytes: int) -> bytes:
    """Read a chunked body and its trailers; HttpError 413 past `max_bytes`."""
    body = bytearray()
    while True:
        line = await inp.read_until(b"\r\n", 1024, "chunk size line")
        size_hex = line.split(b";", 1)[0].strip()
        try:
            size = int(size_hex, 16)
        except ValueError:
            raise HttpError(400, "malformed chunk size") from None
        if size == 0:
            break
        if len(body) + size > max_bytes:
            raise HttpError(413, f"request body larger than {max_bytes} bytes")
        body += await inp.read_exact(size)
        if await inp.read_exact(2) != b"\r\n":
            raise HttpError(400, "malformed chunk")
    while await inp.read_until(b"\r\n", 8192, "trailer"):
        pass  # trailers are read and dropped
    return bytes(body)
