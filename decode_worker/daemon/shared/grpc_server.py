"""The gRPC server of both daemons: grpcio's asyncio server on the caller's running loop.

`GrpcServer(servicer, host, port)` serves smg's `SglangScheduler` service (io/grpc) beside
the HTTP server, on the same event loop, so both doors reach the same app and backend:
- `await start()` binds (port 0 picks a free one, see `port`) and serves; raises OSError
  when the address cannot be bound;
- `await close(grace_s)` stops taking calls, lets calls in flight finish within `grace_s`,
  then cancels them (their runs are aborted and their pages returned, as for a client that
  goes away).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from decode_worker.io.api.app import ApiApp
from decode_worker.io.grpc.servicer import SchedulerServicer
from decode_worker.io.metrics import Metrics

log = logging.getLogger(__name__)


class GrpcServer:
    """Serve `servicer` on (host, port). Start with `await start()`; stop with `close()`."""

    def __init__(self, servicer: SchedulerServicer, host: str, port: int,
                 max_message_bytes: int = 8 * 2**20) -> None:
        self.servicer = servicer
        self.host, self.requested_port = host, port
        self.max_message_bytes = max_message_bytes
        self.port = 0  # the bound port, after start()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind and serve. Raises OSError if the address cannot be bound."""
        limit = self.max_message_bytes
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
        ])
        pb_grpc.add_SglangSchedulerServicer_to_server(self.servicer, server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        try:
            self.port = server.add_insecure_port(f"{host}:{self.requested_port}")
        except RuntimeError as exc:
            raise OSError(f"gRPC: cannot bind {host}:{self.requested_port}: {exc}") from None
        if not self.port:  # older grpcio: 0 instead of an exception
            raise OSError(f"gRPC: cannot bind {host}:{self.requested_port}")
        await server.start()
        self._server = server
        log.info("grpc listening on %s:%d (SglangScheduler)", self.host, self.port)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop taking calls; cancel the calls still running after `grace_s`. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)


async def start_grpc(app: ApiApp, metrics: Metrics | None, settings: Any) -> GrpcServer | None:
    """smg's gRPC service on `server.grpc_port` (None: off) and `server.host`, over `app` (the
    HTTP server's), started; `settings` is a `decode_worker.settings.Settings`."""
    sc = settings.server
    if sc.grpc_port is None:
        return None
    servicer = SchedulerServicer(app, metrics, require_key=sc.grpc_require_api_key)
    if sc.api_key is not None and not sc.grpc_require_api_key:
        log.warning("grpc: server.grpc_require_api_key=false: the gRPC port takes calls "
                    "without the API key (fence it: only the gateway may reach it)")
    server = GrpcServer(servicer, sc.host, sc.grpc_port, sc.max_body_bytes)
    await server.start()
    return server
