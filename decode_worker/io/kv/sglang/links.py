"""The ZMQ sockets between this decode side and SGLang prefill ranks (owner thread only).

- `StatusInbox`: our one PULL socket; every prefill rank PUSHes KV_STATUS and ABORT_ACK to the
  (ip, port) our messages named. Bound once per local address a peer reaches us at.
- `RankLinks`: one PUSH socket per prefill rank of one peer (LINGER 0, never a blocking send),
  each watched by a ZMQ monitor so that a rank's disconnection (it died or restarted) shows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from decode_worker.errors import TransferError
from decode_worker.io.kv.sglang.frames import AbortAck, FrameError, KVStatus
from decode_worker.io.kv.sglang.messages import decode_from_prefill
from decode_worker.io.kv.sglang.server_info import RankEndpoint

log = logging.getLogger(__name__)

Ctx = zmq.Context[zmq.Socket[bytes]]


def _tcp(ip: str, port: int | str) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class StatusInbox:
    """Our PULL socket. `ports` = (lo, hi) confines its ports (None: any free port)."""

    def __init__(self, ctx: Ctx, ports: tuple[int, int] | None = None) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IPV6, 1)
        self._ports = ports
        self._bound: dict[str, int] = {}
        self.bad_frames = 0

    def endpoint_for(self, ip: str) -> int:
        """Our port on local address `ip` (bound on first use). Raises TransferError."""
        if ip in self._bound:
            return self._bound[ip]
        try:
            if self._ports is None:
                self._sock.bind(_tcp(ip, "*"))
                endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
                port = int(bytes(endpoint).decode().rsplit(":", 1)[1])  # type: ignore[arg-type]
            else:
                lo, hi = self._ports
                url = f"tcp://[{ip}]" if ":" in ip else f"tcp://{ip}"
                port = self._sock.bind_to_random_port(url, min_port=lo, max_port=hi + 1,
                                                      max_tries=4 * (hi - lo + 1))  # fmt: skip
        except (zmq.ZMQError, zmq.ZMQBindError) as exc:
            raise TransferError(f"cannot bind the SGLang status socket on {ip}: {exc}") from None
        self._bound[ip] = port
        log.info("SGLang status socket bound on %s", _tcp(ip, port))
        return port

    def recv_all(self) -> list[KVStatus | AbortAck]:
        """Every message waiting; a malformed one is logged, counted (`bad_frames`), skipped."""
        out: list[KVStatus | AbortAck] = []
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode_from_prefill(frames))
            except FrameError as exc:
                self.bad_frames += 1
                log.warning("SGLang status socket: dropped a malformed message: %s", exc)

    def take_bad_frames(self) -> int:
        """Malformed messages dropped since the last call."""
        n, self.bad_frames = self.bad_frames, 0
        return n

    def close(self) -> None:
        self._sock.close()


class RankLinks:
    """PUSH sockets to every rank of one prefill peer, by (dp_rank, tp_rank)."""

    def __init__(self, ctx: Ctx, endpoints: Sequence[RankEndpoint]) -> None:
        self._socks: dict[tuple[int, int], zmq.Socket[bytes]] = {}
        self._monitors: dict[tuple[int, int], zmq.Socket[bytes]] = {}
        for ep in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 0)
            sock.setsockopt(zmq.IPV6, 1)
            self._monitors[ep.dp_rank, ep.tp_rank] = sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED)
            sock.connect(_tcp(ep.ip, ep.port))
            self._socks[ep.dp_rank, ep.tp_rank] = sock

    def send(self, rank: tuple[int, int], frames: Sequence[bytes]) -> None:
        """Queue one message to `rank` = (dp, tp). Raises TransferError if ZMQ refuses it."""
        sock = self._socks.get(rank)
        if sock is None:
            raise TransferError(f"no prefill rank dp={rank[0]} tp={rank[1]}")
        try:
            sock.send_multipart(list(frames), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise TransferError(f"prefill rank dp={rank[0]} tp={rank[1]}: cannot send: "
                                f"{exc}") from None  # fmt: skip

    def disconnected(self) -> tuple[int, int] | None:
        """A rank whose connection dropped since the last call (None: all connected)."""
        for rank, monitor in self._monitors.items():
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                continue
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return rank
        return None

    def close(self) -> None:
        for sock in self._socks.values():
            sock.disable_monitor()
        for monitor in self._monitors.values():
            monitor.close()
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self._monitors.clear()
