"""An asyncio HTTP/1.1 server on asyncio streams (no framework).

Behaviour, per connection:
- keep-alive (HTTP/1.1 default, HTTP/1.0 with `Connection: keep-alive`), idle timeout;
- Content-Length and chunked request bodies, limited to `max_body_bytes` (413, then close);
- a malformed head -> 400 and close; an HTTP/2 preface -> an HTTP/2 GOAWAY (HTTP_1_1_REQUIRED)
  and close; a handler that raises -> 500 (logged);
- while a handler or its stream runs, the server watches the socket; on EOF/reset it sets
  `Request.disconnected` and cancels the handler task (a stream's iterator is `aclose`d).
  A client that half-closes (shutdown(SHUT_WR)) counts as gone.

`close(grace_s)` stops listening, closes idle connections, lets in-flight requests finish
within the grace period and cancels the rest. The listening socket uses SO_REUSEADDR, so a
restarted server rebinds its port at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from decode_worker.io.http.message import Handler, HttpError, Request, error_body
from decode_worker.io.http.parse import (
    ConnectionEnded,
    H2Preface,
    Input,
    body_length,
    read_chunked,
    read_head,
)
from decode_worker.io.http.write import Output

log = logging.getLogger(__name__)

# SETTINGS (empty) then GOAWAY(last stream 0, HTTP_1_1_REQUIRED = 0xd): what an HTTP/2 peer
# must see to give up cleanly (RFC 9113 3.4, 7).
H2_GOAWAY = bytes.fromhex("000000040000000000" "000008070000000000" "00000000" "0000000d")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits of the HTTP server; `max_body_bytes` is settings `server.max_body_bytes`."""

    host: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = 8 * 2**20
    max_head_bytes: int = 64 * 1024
    keep_alive_s: float = 75.0
    read_timeout_s: float = 30.0
    backlog: int = 1024

    @classmethod
    def from_settings(cls, settings: Any) -> ServerConfig:
        """From `decode_worker.settings.Settings` (duck-typed: io does not import settings)."""
        sc = settings.server
        return cls(host=sc.host, port=sc.port, max_body_bytes=sc.max_body_bytes)


class HttpServer:
    """Serve `handler` on (host, port). Start with `await start()`; stop with `await close()`."""

    def __init__(self, handler: Handler, config: ServerConfig) -> None:
        self.handler = handler
        self.config = config
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], bool] = {}  # task -> busy with a request
        self._closing = False

    @property
    def port(self) -> int:
        """The bound port (useful with port 0). Valid after start()."""
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Bind and listen. Raises OSError if the address is taken by a live socket."""
        self._server = await asyncio.start_server(
            self._on_connect, self.config.host, self.config.port,
            reuse_address=True, backlog=self.config.backlog, limit=self.config.max_head_bytes,
        )
        log.info("http listening on %s:%d", self.config.host, self.port)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening; wait up to `grace_s` for busy connections, then cancel them."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task, busy in list(self._conns.items()):
            if not busy:
                task.cancel()
        pending = list(self._conns)
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = False
        peer = writer.get_extra_info("peername")
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        try:
            await self._serve_connection(Input(reader), Output(writer), task, client)
        except (ConnectionEnded, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:
            if not self._closing:
                raise
        except Exception:
            log.exception("http connection %s failed", client)
        finally:
            self._conns.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve_connection(
        self, inp: Input, out: Output, task: asyncio.Task[None], client: str
    ) -> None:
        while not self._closing:
            self._conns[task] = False
            req = await self._read_request(inp, out, client)
            if req is None:
                return
            self._conns[task] = True
            keep = _wants_keep_alive(req) and not self._closing
            keep = await self._dispatch(req, inp, out, keep)
            if not keep:
                return

    async def _read_request(self, inp: Input, out: Output, client: str) -> Request | None:
        """The next request, or None when the connection should end (answered if needed)."""
        cfg = self.config
        try:
            head = await asyncio.wait_for(read_head(inp, cfg.max_head_bytes), cfg.keep_alive_s)
            path, _, query = head.target.partition("?")
            req = Request(head.method, path, query, head.version, head.headers, client=client,
                          received_at=time.monotonic())
            req.body = await asyncio.wait_for(self._read_body(req, inp, out), cfg.read_timeout_s)
            return req
        except H2Preface:
            await out.raw(H2_GOAWAY)
        except HttpError as exc:
            log.info("http %s: %d %s", client, exc.status, exc.message)
            await out.simple(exc.status, error_body(exc.status, exc.message), keep_alive=False)
        return None

    async def _read_body(self, req: Request, inp: Input, out: Output) -> bytes:
        length = body_length(req.headers)
        limit = self.config.max_body_bytes
        if length is not None and length > limit:
            raise HttpError(413, f"request body of {length} bytes exceeds {limit}")
        if (req.header("expect") or "").lower() == "100-continue":
            await out.raw(b"HTTP/1.1 100 Continue\r\n\r\n")
        if length is None:
            return await read_chunked(inp, limit)
        return await inp.read_exact(length) if length else b""

    async def _dispatch(self, req: Request, inp: Input, out: Output, keep: bool) -> bool:
        """Run the handler while watching for a disconnect. Returns whether to keep alive."""
        work = asyncio.ensure_future(self._respond(req, out, keep))
        watch = asyncio.ensure_future(_watch_eof(inp))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                req.disconnected.set()
                work.cancel()
            watch.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled() or work.exception() is not None:
            return False
        return bool(work.result()) and not inp.eof

    async def _respond(self, req: Request, out: Output, keep: bool) -> bool:
        try:
            resp = await self.handler(req)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.path)
            await out.simple(500, error_body(500, "internal server error"), keep_alive=False)
            return False
        t0 = time.perf_counter()
        keep = await out.response(resp, keep, req.version == "HTTP/1.1", req.method == "HEAD")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %s -> %d (%.1f ms)", req.client, req.method, req.path,
                      resp.status, (time.perf_counter() - t0) * 1e3)
        return keep


async def _watch_eof(inp: Input) -> None:
    """Return once the peer has closed; read-ahead (a pipelined request) stays in the buffer."""
    while len(inp.buf) < 1 << 20 and await inp.fill():
        pass
    if not inp.eof:
        await asyncio.Event().wait()  # enough buffered; stop reading, never report EOF


def _wants_keep_alive(req: Request) -> bool:
    conn = (req.header("connection") or "").lower()
    if req.version == "HTTP/1.0":
        return "keep-alive" in conn
    return "close" not in conn
