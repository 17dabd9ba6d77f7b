"""A small asyncio HTTP/1.1 server: `HttpServer(handler, ServerConfig(...))`.

Handlers take a `Request` and return a `Response` or a `StreamResponse` (server-sent events).
"""

from decode_worker.io.http.loop import run
from decode_worker.io.http.message import Handler, Request, Response, StreamResponse, error_body
from decode_worker.io.http.server import HttpServer, ServerConfig

__all__ = [
    "Handler",
    "HttpServer",
    "Request",
    "Response",
    "ServerConfig",
    "StreamResponse",
    "error_body",
    "run",
]
