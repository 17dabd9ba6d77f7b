"""`decode-worker prefill`: run the reference prefill peer until SIGTERM/SIGINT.

Loads the model (the embedded tiny gpt-oss when `model.path` is unset), builds its own pools
(sized by the `cache` settings, no CUDA graphs, no radix cache), serves the ZMQ bootstrap port
(`transfer.bootstrap_port`) and the HTTP API (`server.port`). Prompts come from `POST /generate`
(or the OpenAI routes) with `bootstrap_room`, or in the decode side's transfer requests
(`prompt_ids`, router-less use). With `transfer.prefill_protocol` "sglang" (`--protocol sglang`)
it serves SGLang 0.5.23's protocol instead (`sglang_peer.py`): an HTTP bootstrap server on the
bootstrap port, a rank ZMQ port, and prompts from HTTP only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from pathlib import Path

from decode_worker.daemon.prefill.backend import PrefillBackend
from decode_worker.daemon.prefill.peer import PrefillPeer
from decode_worker.daemon.prefill.sglang_peer import SglangPrefillPeer
from decode_worker.daemon.shared.grpc_server import start_grpc
from decode_worker.daemon.shared.http_server import (
    HttpServer,
    ServerConfig,
    bind_http,
    write_ports_file,
)
from decode_worker.daemon.shared.runtime import build_runtime
from decode_worker.device.runner import ModelRunner
from decode_worker.io.api.app import ApiApp
from decode_worker.io.api.common import ApiConfig
from decode_worker.io.metrics import Metrics
from decode_worker.settings import LoadedSettings, Settings

log = logging.getLogger(__name__)

def build_runner(settings: Settings) -> tuple[ModelRunner, str, Path]:
    """Load the model and size pools for it (the decode worker's own `build_runtime`, without
    CUDA graphs); returns the runner, the model's name and dir.

    Raises ConfigError for a missing/broken model or pools that do not fit.
    """
    rt = build_runtime(settings, use_cuda_graph=False)
    return rt.runner, rt.model_name, rt.model_dir


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    settings = loaded.settings
    sock = bind_http(settings)  # before the model loads: a taken port is one line at once
    try:
        return _run(settings, sock, getattr(args, "ports_file", None))
    finally:
        sock.close()


def _run(settings: Settings, sock: socket.socket, ports_file: Path | None) -> int:
    http_port = int(sock.getsockname()[1])
    runner, name, model_dir = build_runner(settings)
    wait_s = settings.scheduler.kv_timeout_s
    peer: PrefillPeer | SglangPrefillPeer
    metrics = Metrics()  # HTTP requests, request outcomes, prefill time (TTFT / e2e)
    if settings.transfer.prefill_protocol == "sglang":
        peer = SglangPrefillPeer(runner, settings.transfer, http_port, match_timeout_s=wait_s)
    else:
        peer = PrefillPeer(runner, settings.transfer, name, match_timeout_s=wait_s,
                           metrics=metrics)
    try:
        backend = PrefillBackend(peer, model_dir, wait_s, metrics=metrics,
                                 context_length=runner.model.cfg.max_position_embeddings)
        app = ApiApp(backend, ApiConfig.from_settings(settings), metrics)
        server = HttpServer(app, ServerConfig.from_settings(settings), sock)
        asyncio.run(_serve(server, app, metrics, settings, peer, runner, ports_file))
    finally:
        peer.close()
        runner.destroy()
    return 0


async def _serve(server: HttpServer, app: ApiApp, metrics: Metrics, settings: Settings,
                 peer: PrefillPeer | SglangPrefillPeer, runner: ModelRunner,
                 ports_file: Path | None) -> None:
    """Serve HTTP (and gRPC, `server.grpc_port`) until SIGTERM/SIGINT, then stop taking
    requests (grace `drain_grace_s`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    grpc_server = await start_grpc(app, metrics, settings)
    t, pools = settings.transfer, runner.pools
    ports = {"http": server.port, "bootstrap": peer.server.port}
    log.info("prefill peer ready: agent %s, http %s:%d, bootstrap %s:%d, page %d, %d full / %d "
             "swa pages", peer.agent.name, settings.server.host, server.port, t.bootstrap_host,
             peer.server.port, pools.page_size, pools.num_pages["full"], pools.num_pages["swa"])
    if isinstance(peer, SglangPrefillPeer):
        ports["rank"] = peer.channel.port
        log.info("prefill peer speaks sglang: bootstrap HTTP %s:%d, rank ZMQ port %d",
                 t.bootstrap_host, peer.server.port, peer.channel.port)
    if grpc_server is not None:
        ports["grpc"] = grpc_server.port
    if ports_file is not None:
        write_ports_file(ports_file, ports)
    await stop.wait()
    log.info("prefill peer: stopping")
    await server.close(grace_s=settings.server.drain_grace_s)
    if grpc_server is not None:
        await grpc_server.close(grace_s=2.0)
