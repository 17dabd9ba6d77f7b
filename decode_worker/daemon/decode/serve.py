"""`decode-worker serve`: the decode worker process (one per device).

The main thread runs the asyncio (uvloop) event loop: HTTP, signals, metrics. One compute thread
(`DecodeEngine`) owns torch, the pools, the tree, the scheduler and NIXL; they meet only through
the bridge's inbox and outbox.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path

from decode_worker.daemon.decode.backend import DecodeBackend
from decode_worker.daemon.decode.bridge import Drain, Outbox, Shutdown
from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.daemon.decode.faults import arm_test_faults
from decode_worker.daemon.shared.grpc_server import GrpcServer, start_grpc
from decode_worker.daemon.shared.http_server import (
    HttpServer,
    ServerConfig,
    bind_http,
    write_ports_file,
)
from decode_worker.daemon.shared.http_server import run as run_loop
from decode_worker.io.api.app import ApiApp, check_model_path
from decode_worker.io.api.common import ApiConfig
from decode_worker.io.kv_events.config import describe
from decode_worker.io.kv_events.publisher import ZmqKvEventPublisher
from decode_worker.io.metrics import Metrics
from decode_worker.settings import LoadedSettings, Settings

log = logging.getLogger(__name__)


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Build the engine (model, pools, tree), serve until SIGTERM/SIGINT, drain, exit."""
    settings = loaded.settings
    sock = bind_http(settings)  # before the model loads: a taken port is one line at once
    metrics = Metrics()
    kv_cfg = settings.kv_events.parsed
    # the sockets first: a busy or bad endpoint stops the daemon before the model loads
    publisher = None
    try:
        publisher = ZmqKvEventPublisher.bind(kv_cfg, metrics) if kv_cfg.enabled else None
        engine = DecodeEngine.build(settings, metrics)
        arm_test_faults(engine, os.environ)
        if publisher is not None and engine.kv_events is not None:
            publisher.start(engine.kv_events)
        elif publisher is not None:
            log.warning("kv_events.config: publisher zmq, but the decode radix cache is off: "
                        "the tree caches nothing, so no KV events are published")
        elif engine.kv_events is not None:
            log.info("KV events: served over gRPC (SubscribeKvEvents) from the in-process "
                     "log; no ZMQ publisher (kv_events.config unset)")
        serving = _serve(settings, engine, metrics, sock, getattr(args, "ports_file", None),
                         publisher)
        return int(run_loop(serving))
    finally:
        sock.close()
        if publisher is not None:
            publisher.close()


async def _serve(settings: Settings, engine: DecodeEngine, metrics: Metrics,
                 sock: socket.socket, ports_file: Path | None,
                 publisher: ZmqKvEventPublisher | None = None) -> int:
    loop = asyncio.get_running_loop()
    events_cfg = settings.kv_events.parsed if publisher is None else publisher.bound_config()
    backend = DecodeBackend(engine.inbox, engine.tokenizer, engine.info,
                            settings.scheduler.max_queued_requests,
                            settings.transfer.bootstrap_port, loads=engine.books,
                            kv_events=engine.kv_events,
                            kv_events_info=describe(events_cfg, engine.page_size),
                            host_tier_info=engine.host_tier_info)
    # answers wait for the ZMQ publisher's sends of their steps' KV events (`AnswerGate`)
    engine.start(Outbox(loop, backend.deliver,
                        gate=publisher.gate if publisher is not None else None))
    app = ApiApp(backend, ApiConfig.from_settings(settings), metrics)
    sc = settings.server
    warning = check_model_path(backend.server_info())
    if warning:
        log.warning("%s", warning)
    server = HttpServer(app, ServerConfig.from_settings(settings), sock)
    await server.start()
    grpc_server = await start_grpc(app, metrics, settings)
    if ports_file is not None:  # once every listener is up: a reader may connect at once
        write_ports_file(ports_file, {"http": server.port, **bound_ports(grpc_server, publisher)})
    stop = _install_signals(loop)
    cache = settings.cache
    log.info("decode worker ready on http://%s:%d (page %d, %d full pages, "
             "disaggregation_decode_enable_radix_cache=%s, enable_unified_radix_tree=%s, "
             "enable_hierarchical_cache=%s)",
             sc.host, server.port, engine.page_size, engine.full.num_total,
             cache.decode_radix_cache, cache.decode_radix_cache and cache.unified_radix_tree,
             engine.host_tier is not None)
    stopper = asyncio.ensure_future(stop.wait())
    dead = asyncio.ensure_future(_wait_dead(backend))
    await asyncio.wait({stopper, dead}, return_when=asyncio.FIRST_COMPLETED)
    code = 1 if backend.dead_reason else 0
    await _shutdown(settings, engine, backend, (server, grpc_server), metrics)
    for task in (stopper, dead):
        task.cancel()
    return code


def bound_ports(grpc_server: GrpcServer | None,
                publisher: ZmqKvEventPublisher | None) -> dict[str, int]:
    """The ports beside HTTP that `--ports-file` reports: "grpc", "kv_events",
    "kv_events_replay" (each only when bound)."""
    ports = {} if grpc_server is None else {"grpc": grpc_server.port}
    return {**ports, **(publisher.bound_ports() if publisher is not None else {})}


async def _shutdown(settings: Settings, engine: DecodeEngine, backend: DecodeBackend,
                    servers: tuple[HttpServer, GrpcServer | None], metrics: Metrics) -> None:
    """Ordered shutdown; each step bounded so a stuck part cannot hold the process."""
    grace = settings.server.drain_grace_s
    metrics.set_draining(True)
    # 1. announce: /health says draining while requests are still taken, long enough for the
    #    routers' health checks to stop sending any (a dead engine has nothing to announce).
    if backend.dead_reason is None:
        await _announce(backend, settings.server.drain_announce_s)
    # 2. stop admission: new requests get 503 + Retry-After.
    backend.draining = True
    log.info("draining: %d requests in flight, grace %.1fs", backend.num_active, grace)
    # 3. running requests get the grace period; the engine aborts the rest with reason "drain".
    engine.inbox.put(Drain(grace))
    deadline = time.monotonic() + grace + 2.0
    while backend.num_active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    # 4. stop HTTP and gRPC (answers are out), then the compute thread: it releases NIXL and
    # the device.
    http, grpc_server = servers
    await http.close(grace_s=2.0)
    if grpc_server is not None:
        await grpc_server.close(grace_s=2.0)
    engine.inbox.put(Shutdown())
    await asyncio.get_running_loop().run_in_executor(None, engine.join, 30.0)
    log.info("decode worker stopped")


async def _announce(backend: DecodeBackend, announce_s: float) -> None:
    """`server.drain_announce_s` of /health 503 while new requests are still served (an idle
    worker waits too: a router learns that it goes only from a health check). Ends early if
    the engine dies."""
    backend.announcing = True
    log.info("draining: /health answers 503 for %.1fs while still serving "
             "(server.drain_announce_s), %d requests in flight", announce_s, backend.num_active)
    deadline = time.monotonic() + announce_s
    while backend.dead_reason is None and time.monotonic() < deadline:
        await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


async def _wait_dead(backend: DecodeBackend) -> None:
    while backend.dead_reason is None:
        await asyncio.sleep(0.2)


def _install_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """First SIGTERM/SIGINT starts the drain; a second one exits at once."""
    stop = asyncio.Event()

    def _on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second signal %d: exiting now", signum)
            _hard_exit()
        log.info("signal %d: draining", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, _on_signal, sig)
    return stop


def _hard_exit() -> None:
    logging.shutdown()
    os._exit(1)  # forced: requests in flight are lost, so say so to the supervisor
