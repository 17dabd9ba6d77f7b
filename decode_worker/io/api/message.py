"""Requests and responses as plain values (no I/O): what a handler receives and returns.

A handler is `async def handler(req: Request) -> Response | StreamResponse`. The ASGI adapter
(`asgi.py`) owns the connection; a handler never writes to it. `Request.disconnected` is set by
the adapter when the client goes away while the handler (or its stream) is running; the adapter
then cancels the handler task, so handlers normally need not poll it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgspec

_JSON = msgspec.json.Encoder()


@dataclass(slots=True)
class Request:
    """One parsed HTTP/1.x request with its whole body read.

    `headers` keys are lower case; a repeated header's values are joined with ", ".
    """

    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]
    body: bytes = b""
    client: str = ""
    received_at: float = 0.0  # time.monotonic() when the head was read
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


@dataclass(slots=True)
class Response:
    """A complete response; the adapter adds content-length (the server: date, server)."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def json(
        cls, obj: Any, status: int = 200, headers: Iterable[tuple[str, str]] = ()
    ) -> Response:
        return cls(status, _JSON.encode(obj), "application/json", list(headers))

    @classmethod
    def text(cls, text: str, status: int = 200, content_type: str = "text/plain") -> Response:
        return cls(status, text.encode(), f"{content_type}; charset=utf-8")


@dataclass(slots=True)
class StreamResponse:
    """A response whose body is produced while it is sent (server-sent events).

    The adapter sends the head at once, then each chunk as it comes (chunked encoding). It
    always closes `chunks` (`aclose`) when it stops, normally or not, so an async generator's
    `finally` sees a disconnect.
    """

    status: int
    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def error_body(status: int, message: str, err_type: str | None = None) -> bytes:
    """The JSON error body every layer uses: `{"error": {"message", "type", "code"}}`."""
    kind = err_type or reason(status).lower().replace(" ", "_")
    return _JSON.encode({"error": {"message": message, "type": kind, "code": status}})
