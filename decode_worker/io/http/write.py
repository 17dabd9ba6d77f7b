"""Writing HTTP/1.x responses to an asyncio StreamWriter."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils

from decode_worker.io.http.message import Response, StreamResponse, reason

SERVER_NAME = "decode-worker"


class Output:
    """The write side of one connection. Raises ConnectionError when the peer is gone."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def raw(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def simple(self, status: int, body: bytes, keep_alive: bool) -> None:
        """A JSON response, e.g. an error the server answers itself."""
        await self.response(Response(status, body), keep_alive, True, False)

    async def response(
        self, resp: Response | StreamResponse, keep_alive: bool, http11: bool, head_only: bool
    ) -> bool:
        """Send `resp`; returns whether the connection may be kept alive afterwards."""
        if isinstance(resp, Response):
            head = _head(resp.status, resp.content_type, resp.headers, keep_alive)
            head += f"content-length: {len(resp.body)}\r\n\r\n".encode("latin-1")
            await self.raw(head if head_only else head + resp.body)
            return keep_alive
        return await self._stream(resp, keep_alive and http11, http11, head_only)

    async def _stream(
        self, resp: StreamResponse, keep_alive: bool, chunked: bool, head_only: bool
    ) -> bool:
        extra = "transfer-encoding: chunked\r\n" if chunked else ""
        head = _head(resp.status, resp.content_type, resp.headers, keep_alive)
        head += f"cache-control: no-cache\r\nx-accel-buffering: no\r\n{extra}\r\n".encode()
        try:
            await self.raw(head)
            if head_only:
                return False
            async for chunk in resp.chunks:
                if not chunk:
                    continue
                await self.raw(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if chunked:
                await self.raw(b"0\r\n\r\n")
        finally:
            aclose = getattr(resp.chunks, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        return keep_alive


def _head(status: int, content_type: str, extra: list[tuple[str, str]], keep_alive: bool) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {reason(status)}",
        f"server: {SERVER_NAME}",
        f"date: {email.utils.formatdate(usegmt=True)}",
        f"content-type: {content_type}",
        f"connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    lines += [f"{name}: {value}" for name, value in extra]
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")
