"""A test handler and raw-socket helpers for the ASGI/uvicorn server tests."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from decode_worker.io.api.message import Request, Response, StreamResponse


class Handler:
    """Echoes the body; /stream streams 5 chunks slowly, /endless without end; /slow sleeps;
    /meta answers the parsed request; records cancellations and closed streams."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.closed_streams = 0
        self.seen: list[str] = []

    async def __call__(self, req: Request) -> Response | StreamResponse:
        self.seen.append(req.path)
        if req.path in ("/stream", "/endless"):
            return StreamResponse(200, self._chunks(5 if req.path == "/stream" else 1 << 30))
        if req.path == "/slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.append(req.path)
                raise
        if req.path == "/boom":
            raise RuntimeError("handler bug")
        if req.path == "/inject":
            return Response(200, b"x", "text/plain", [("x-a", "1\r\nset-cookie: evil=1")])
        if req.path == "/meta":
            return Response.json({"method": req.method, "path": req.path, "query": req.query,
                                  "version": req.version, "headers": req.headers,
                                  "client": req.client, "received_at": req.received_at})
        return Response(200, req.body or req.method.encode(), "text/plain")

    async def _chunks(self, n: int) -> AsyncIterator[bytes]:
        try:
            for i in range(n):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.2)
        finally:
            self.closed_streams += 1


def raw(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    """Send `data` on a fresh connection; everything until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def recv_until_closed(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out
