"""An ASGI 3 app over a `Handler` (such as `ApiApp`): what uvicorn runs.

Per request (scope type "http"; lifespan is off and nothing else is served):
- a `Request` from the scope: method, raw path (not percent-decoded), query, "HTTP/x.y",
  header names in lower case with a repeated header's values joined by ", ", client
  "ip:port", `received_at` = time.monotonic() when the head had been parsed;
- the body, read whole before the handler runs: 413 and close when Content-Length or the
  (chunked) body passes `max_body_bytes`; 408 and close when it is not complete within
  `read_timeout_s` (a slow or stalled client cannot hold a request open);
- while the handler and its stream run, a watcher waits for `http.disconnect`; when the client
  goes away it sets `Request.disconnected` and cancels the handler task (which aborts the run);
- a `Response` is sent with content-length (uvicorn sends no body for HEAD), a
  `StreamResponse` with chunked encoding, its iterator always `aclose`d, normally or not;
- a handler that raises gets a JSON 500 and the connection closes.
Limits on the head (431, 408) and HTTP/2 probes are the protocol's (`http_protocol.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from decode_worker.io.api.message import Handler, Request, Response, StreamResponse, error_body

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _Refused(Exception):
    """A request answered with an error before the handler runs (then the link closes)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Gone(Exception):
    """The client went away while its body was read."""


class _Progress:
    """Whether the response is complete (then a later `http.disconnect` means nothing)."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = False


class AsgiApp:
    """Serve `handler` as an ASGI 3 app. Stateless between requests; event loop only."""

    def __init__(self, handler: Handler, max_body_bytes: int = 8 * 2**20,
                 read_timeout_s: float = 30.0) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        req = build_request(scope)
        try:
            async with asyncio.timeout(self.read_timeout_s):
                req.body = await self._read_body(req, receive)
        except _Refused as exc:
            log.info("http %s: %d %s", req.client, exc.status, exc.message)
            await send_error(send, exc.status, exc.message)
            return
        except TimeoutError:
            await send_error(send, 408, f"request body not received in {self.read_timeout_s:g}s")
            return
        except _Gone:
            return
        try:
            await self._dispatch(req, receive, send)
        except asyncio.CancelledError:
            # only the server's last resort at shutdown cancels this task (a handler that
            # outlived its aborted connection); the handler is cancelled and its stream closed
            # already. Returning spares uvicorn's log a traceback per request cut short.
            log.info("%s %s from %s cut short at shutdown", req.method, req.path, req.client)

    async def _read_body(self, req: Request, receive: Receive) -> bytes:
        """The whole body. Raises _Refused (413/400) past the limit, _Gone on a disconnect."""
        limit = self.max_body_bytes
        length = req.header("content-length")
        if length is not None:
            if not length.isdigit():  # httptools checked it already; be sure before int()
                raise _Refused(400, "invalid Content-Length")
            if int(length) > limit:
                raise _Refused(413, f"request body of {length} bytes exceeds {limit}")
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone
            body += message.get("body", b"")
            if len(body) > limit:
                raise _Refused(413, f"request body exceeds {limit} bytes")
            if not message.get("more_body", False):
                return bytes(body)

    async def _dispatch(self, req: Request, receive: Receive, send: Send) -> None:
        """Run the handler and send its answer while watching for the client going away."""
        progress = _Progress()
        work = asyncio.ensure_future(self._respond(req, send, progress))
        watch = asyncio.ensure_future(_wait_disconnect(receive, progress))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                req.disconnected.set()
                work.cancel()
            watch.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)

    async def _respond(self, req: Request, send: Send, progress: _Progress) -> None:
        try:
            resp = await self.handler(req)
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.path)
            progress.finished = True
            await send_error(send, 500, "internal server error")
            return
        try:
            if isinstance(resp, Response):
                progress.finished = True
                await send_response(send, resp)
            else:
                await send_stream(send, resp, progress, head_only=req.method == "HEAD")
        except Exception:  # a broken stream or header: uvicorn then closes the connection
            log.exception("sending the answer to %s %s failed", req.method, req.path)


def build_request(scope: Scope) -> Request:
    """A `Request` (without body) from an ASGI http scope."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    client = scope.get("client")
    raw_path = scope.get("raw_path") or scope["path"].encode()
    return Request(
        method=scope["method"], path=raw_path.decode("latin-1"),
        query=scope.get("query_string", b"").decode("latin-1"),
        version=f"HTTP/{scope.get('http_version', '1.1')}", headers=headers,
        client=f"{client[0]}:{client[1]}" if client else "", received_at=time.monotonic(),
    )


async def send_error(send: Send, status: int, message: str) -> None:
    """A JSON error answer that closes the connection."""
    await send_response(send, Response(status, error_body(status, message),
                                       headers=[("connection", "close")]))


async def send_response(send: Send, resp: Response) -> None:
    headers = _headers(resp.content_type, resp.headers)
    headers.append((b"content-length", b"%d" % len(resp.body)))
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    await send({"type": "http.response.body", "body": resp.body})


async def send_stream(send: Send, resp: StreamResponse, progress: _Progress,
                      head_only: bool = False) -> None:
    """Send the head, then each chunk as it comes (none for HEAD); `resp.chunks` is always
    closed."""
    headers = _headers(resp.content_type, resp.headers)
    headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    try:
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        async for chunk in _nothing() if head_only else resp.chunks:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        progress.finished = True
        await send({"type": "http.response.body", "body": b""})
    finally:
        aclose = getattr(resp.chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


def _headers(content_type: str, extra: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", content_type.encode("latin-1"))]
    out += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in extra]
    return out


async def _nothing() -> AsyncIterator[bytes]:
    """No chunks (a HEAD request's stream)."""
    empty: tuple[bytes, ...] = ()
    for chunk in empty:
        yield chunk


async def _wait_disconnect(receive: Receive, progress: _Progress) -> None:
    """Return when the client goes away before the response is complete."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not progress.finished:
                return
            await asyncio.Event().wait()  # uvicorn says "disconnect" after a complete answer too
