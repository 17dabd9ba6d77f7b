"""A misbehaving prefill peer for the soak's duplicate/late-completion fault: a real ZMQ ROUTER
speaking the native protocol (`io/kv/protocol.py`'s codec) that handshakes correctly and then,
for every transfer request, sends an undecodable frame, the TransferDone twice although no KV
was written, completions and acks for transfers that do not exist, a TransferFailed, and one
more TransferDone a second later (late). The decode worker must answer the request (with an
error: no KV came) and keep its books."""

from __future__ import annotations

import threading
import time

import zmq

from decode_worker.errors import ProtocolError
from decode_worker.io.kv import protocol as p


class RoguePeer:
    """Bound on a free loopback port (`port`) from construction; serves while used as a context
    manager."""

    def __init__(self) -> None:
        self.requests = 0
        self.sent = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:0")  # any free port: no race with a pick
        self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._late: list[tuple[float, bytes, p.Message]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="soak-rogue", daemon=True)

    def __enter__(self) -> RoguePeer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50, zmq.POLLIN):
                frames = self._sock.recv_multipart()
                if len(frames) == 2:
                    self._on(frames[0], frames[1])
            now = time.monotonic()
            for item in [x for x in self._late if x[0] <= now]:
                self._late.remove(item)
                self._send(item[1], item[2])

    def _send(self, who: bytes, msg: p.Message | bytes) -> None:
        raw = msg if isinstance(msg, bytes) else p.encode(msg)
        try:
            self._sock.send_multipart([who, raw], zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError:
            pass  # the decode side went away: nothing to misbehave at

    def _on(self, who: bytes, raw: bytes) -> None:
        try:
            msg = p.decode(raw)
        except ProtocolError:
            return
        match msg:
            case p.Hello(compat=compat):
                self._send(who, p.Welcome(p.PROTOCOL_VERSION, compat, "soak-rogue", 1.0))
            case p.Ping(seq=seq):
                self._send(who, p.Pong(seq))
            case p.TransferRequest(transfer_id=tid, room=room):
                self.requests += 1
                self._misbehave(who, tid, room)
            case p.Abort(transfer_id=tid, room=room):
                for _ in range(2):  # a duplicate ack
                    self._send(who, p.AbortAck(tid, room))

    def _misbehave(self, who: bytes, tid: int, room: int) -> None:
        done = p.TransferDone(tid, room, 0, 0)
        for msg in (b"\x00not msgpack", done, done, p.TransferDone(tid + 7919, room, 1, 1),
                    p.AbortAck(tid + 7919, room), p.TransferFailed(tid + 104729, room, "x"),
                    p.TransferFailed(tid, room, "soak rogue peer: no KV for you")):
            self._send(who, msg)
        self._late.append((time.monotonic() + 1.0, who, done))
        self._late.append((time.monotonic() + 1.5, who, p.AbortAck(tid, room)))
