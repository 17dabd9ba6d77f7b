"""The native receiver's control connection (`BootstrapClient`) tells at once when the prefill
peer is not there (connection refused) or went away (connection closed), from its ZMQ monitor,
instead of waiting `peer_dead_after_s` for a handshake or heartbeat answer. Loopback only."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import zmq

from decode_worker.io.kv.bootstrap import BootstrapClient


def _until(fn: Callable[[], str | None], timeout_s: float = 2.0) -> tuple[str | None, float]:
    start = time.monotonic()
    while (why := fn()) is None and time.monotonic() - start < timeout_s:
        time.sleep(0.005)
    return why, time.monotonic() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_connection_shows_at_once() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = BootstrapClient(ctx, "127.0.0.1", _free_port())
    try:
        why, took = _until(client.connection_lost)
        assert why is not None and "unreachable" in why and took < 0.5
    finally:
        client.close()
        ctx.term()


def test_a_live_peer_is_quiet_and_its_exit_shows_at_once() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = BootstrapClient(ctx, "127.0.0.1", port)
    try:
        why, _ = _until(client.connection_lost, 0.3)
        assert why is None  # connected, and it stays
        server.close()  # the peer's process exits: its sockets close
        why, took = _until(client.connection_lost)
        assert why is not None and "connection closed" in why and took < 0.5
    finally:
        client.close()
        ctx.term()
