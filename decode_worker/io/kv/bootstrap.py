"""The ZMQ control plane between a decode worker and a prefill peer.

- `BootstrapServer` (prefill side): one ROUTER socket on `transfer.bootstrap_host:port`, served by
  its own thread. Each decoded message goes to a handler that returns the replies; other threads
  send with `send()` (queued, written by the server thread: a ZMQ socket has one owner).
- `BootstrapClient` (decode side): one DEALER socket per peer, used only by the thread that owns
  the receiver; every call is non-blocking. A ZMQ monitor on it shows a refused connection
  (the peer is not there) and a dropped one (it exited or restarted) at once.

Frames are `protocol.encode`d messages; an undecodable frame is logged and dropped (a peer cannot
kill the server with garbage).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from decode_worker.errors import ProtocolError, TransferError
from decode_worker.io.kv import protocol
from decode_worker.io.kv.protocol import Message

log = logging.getLogger(__name__)

# (peer identity, message) -> replies to that peer
Handler = Callable[[bytes, Message], list[Message]]


class BootstrapServer:
    """Serve the control plane on tcp://host:port until `close()` (port 0: any free port;
    `port` is the bound one).

    Raises TransferError if the port cannot be bound.
    """

    def __init__(self, host: str, port: int, handler: Handler, poll_ms: int = 5) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise TransferError(f"bootstrap server cannot bind {host}:{port}: {exc}") from None
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.port = int(bytes(endpoint).decode().rsplit(":", 1)[1])  # type: ignore[arg-type]
        self._handler = handler
        self._poll_ms = poll_ms
        self._outbox: queue.SimpleQueue[tuple[bytes, Message]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="bootstrap-server", daemon=True)
        self._thread.start()

    def send(self, peer: bytes, msg: Message) -> None:
        """Queue `msg` for `peer` (thread-safe; written within `poll_ms`)."""
        self._outbox.put((peer, msg))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(self._poll_ms, zmq.POLLIN):
                self._drain_inbound()
            self._flush_outbox()

    def _drain_inbound(self) -> None:
        while True:
            try:
                peer, raw = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not exactly two frames
                log.warning("bootstrap: dropped a frame with an unexpected shape")
                continue
            try:
                msg = protocol.decode(raw)
                replies = self._handler(peer, msg)
            except ProtocolError as exc:
                log.warning("bootstrap: peer %s: %s", peer.hex(), exc)
                replies = [protocol.Refused(reason=str(exc))]
            except Exception:  # loop boundary: one bad message never stops the server
                log.exception("bootstrap: handler failed on a message from %s", peer.hex())
                continue
            for reply in replies:
                self._write(peer, reply)

    def _flush_outbox(self) -> None:
        while True:
            try:
                peer, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._write(peer, msg)

    def _write(self, peer: bytes, msg: Message) -> None:
        try:
            self._sock.send_multipart([peer, protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
            log.info("bootstrap: cannot send %s to %s: %s", type(msg).__name__, peer.hex(), exc)


class BootstrapClient:
    """A DEALER connection to one prefill peer. Not thread-safe: one owner thread."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int) -> None:
        """Raises TransferError for an address ZMQ cannot connect to (empty host, bad port)."""
        self.address = f"{host}:{port}"
        if not host or not 0 < port < 65536:
            raise TransferError(f"bad prefill bootstrap address {host!r}:{port}")
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        ipv6 = ":" in host
        self._sock.setsockopt(zmq.IPV6, int(ipv6))
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._connected = False
        try:
            self._sock.connect(f"tcp://[{host}]:{port}" if ipv6 else f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self.close()
            raise TransferError(f"cannot reach prefill peer {self.address}: {exc}") from None

    def connection_lost(self) -> str | None:
        """Why the connection is gone, once it is: refused before it ever connected, or closed
        after (the peer exited or restarted: it lost our handshake); None while it stands or
        is still being made."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return None
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                return "connection closed (the prefill peer exited or restarted)"
            elif not self._connected:  # EVENT_CONNECT_RETRIED: refused, nothing listens
                return "prefill peer unreachable: connection refused"

    def send(self, msg: Message) -> None:
        """Queue one message. Raises TransferError if ZMQ refuses it (queue full)."""
        try:
            self._sock.send(protocol.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransferError(f"peer {self.address}: cannot send: {exc}") from None

    def recv_all(self) -> list[Message]:
        """Every message that has arrived; bad frames are logged and skipped."""
        out: list[Message] = []
        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(protocol.decode(raw))
            except ProtocolError as exc:
                log.warning("peer %s: %s", self.address, exc)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
