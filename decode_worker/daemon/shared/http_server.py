"""The HTTP server of both daemons: uvicorn (httptools) inside the caller's running event loop.

`HttpServer(handler, ServerConfig(...))` serves a `Handler` (`ApiApp`) through the ASGI
adapter (`io/api/asgi.py`) and the limited httptools protocol (`io/api/http_protocol.py`):
- `await start()` binds (SO_REUSEADDR, so a restarted server rebinds its port at once; port 0
  picks a free one, see `port`) and serves in a task of the running loop. It raises OSError
  when the address is taken. A daemon binds first with `bind_http(settings)`, before it loads
  the model (a taken port is one line at once), and hands the socket to `HttpServer(sock=)`;
- `write_ports_file(path, ports)`: the bound ports as JSON (`--ports-file`), for a parent that
  started the daemon with port 0;
- uvicorn installs no signal handlers: the daemon owns SIGTERM/SIGINT (drain, then exit);
- `await close(grace_s)` stops listening, closes idle connections, lets requests in flight
  finish within `grace_s` and then cancels them (streams are closed, runs aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import socket
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn

from decode_worker.errors import ConfigError
from decode_worker.io.api.asgi import AsgiApp
from decode_worker.io.api.http_protocol import limited_protocol
from decode_worker.io.api.message import Handler

log = logging.getLogger(__name__)
T = TypeVar("T")
SERVER_NAME = "decode-worker"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits of the HTTP server; `max_body_bytes` is settings `server.max_body_bytes`.

    `keep_alive_s`: idle time allowed before a request (also the first); `read_timeout_s`:
    time allowed for a head after its first byte, and for a whole body."""

    host: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = 8 * 2**20
    max_head_bytes: int = 64 * 1024
    keep_alive_s: float = 75.0
    read_timeout_s: float = 30.0
    backlog: int = 1024

    @classmethod
    def from_settings(cls, settings: Any) -> ServerConfig:
        """From `decode_worker.settings.Settings` (server.host, .port, .max_body_bytes)."""
        sc = settings.server
        return cls(host=sc.host, port=sc.port, max_body_bytes=sc.max_body_bytes)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handling alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Serve `handler` on (host, port). Start with `await start()`; stop with `await close()`."""

    def __init__(self, handler: Handler, config: ServerConfig,
                 sock: socket.socket | None = None) -> None:
        """`sock`: bound by `bind_http` (listened on at start); None: bind at start."""
        self.handler = handler
        self.config = config
        self._sock: socket.socket | None = sock
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0). Valid after start()."""
        assert self._sock is not None, "start() first"
        return int(self._sock.getsockname()[1])

    async def start(self) -> None:
        """Bind, listen and serve. Raises OSError if the address is taken by a live socket."""
        cfg = self.config
        if self._sock is None:
            self._sock = _bind(cfg.host, cfg.port)
        self._sock.listen(cfg.backlog)
        self._server = _Server(self._uvicorn_config())
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:  # startup is a few loop turns: no bind, no lifespan
            if self._task.done():
                self._task.result()  # raises what startup raised
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # let uvicorn's first tick set the date and server headers
        log.info("http listening on %s:%d", cfg.host, self.port)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening and close idle connections; wait up to `grace_s` for requests in
        flight, then abort their connections: the adapter sees each disconnect, cancels the
        handler and closes its stream (the run is aborted). Bounded: a handler that ignores
        the cancel is cancelled again, the server task last of all."""
        server, task = self._server, self._task
        if server is None or task is None or task.done():
            return
        server.should_exit = True  # uvicorn's main loop sees it within 0.1 s and shuts down
        if not (await asyncio.wait({task}, timeout=grace_s))[0]:
            conns = list(server.server_state.connections)
            log.warning("http: %d connection(s) still busy after %.1fs; closing them",
                        len(conns), grace_s)
            for conn in conns:
                conn.transport.abort()  # close() would wait for a stalled reader's buffer
        for stubborn in (server.server_state.tasks, {task}):
            if (await asyncio.wait({task}, timeout=2.0))[0]:
                break
            for late in list(stubborn):
                late.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.result()  # raises what the server task failed with

    def _uvicorn_config(self) -> uvicorn.Config:
        cfg = self.config
        app = AsgiApp(self.handler, cfg.max_body_bytes, cfg.read_timeout_s)
        return uvicorn.Config(
            app, http=limited_protocol(cfg.max_head_bytes, cfg.read_timeout_s), ws="none",
            lifespan="off", interface="asgi3", log_config=None, log_level="warning",
            access_log=False, proxy_headers=False, server_header=False,
            headers=[("server", SERVER_NAME)], backlog=cfg.backlog,
            timeout_keep_alive=cfg.keep_alive_s,  # type: ignore[arg-type]  # float is fine
        )


def bind_http(settings: Any) -> socket.socket:
    """The HTTP socket of `settings.server` (host, port), bound but not yet listening (a
    connection before `start()` is refused, not left waiting while the model loads). Raises
    ConfigError naming `server.port` when the address is taken or cannot be bound."""
    sc = settings.server
    try:
        return _bind(sc.host, sc.port)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(f"server.port = {sc.port}: cannot bind {sc.host}:{sc.port}: {why} "
                          f"(pick another with --port or DECODE_WORKER_SERVER__PORT)") from None


def write_ports_file(path: str | os.PathLike[str], ports: dict[str, int]) -> None:
    """Write `ports` (name -> bound port) as one JSON object to `path`, atomically (a reader
    never sees half a file)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(ports, f)
    os.replace(tmp, path)


def _bind(host: str, port: int) -> socket.socket:
    """A bound, non-blocking TCP socket with SO_REUSEADDR (IPv4 or IPv6 as `host` resolves);
    `listen()` is the caller's."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def has_uvloop() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def run(main: Coroutine[Any, Any, T], use_uvloop: bool = True) -> T:
    """Run `main` to completion on uvloop if available (and wanted), else on asyncio's loop."""
    if use_uvloop and has_uvloop():
        import uvloop

        return uvloop.run(main)  # type: ignore[no-any-return]
    return asyncio.run(main)
