"""The ZMQ side of one prefill rank speaking SGLang 0.5.23's protocol (NIXL backend).

- One PULL socket (`RankChannel.port`, registered with the bootstrap server as the rank's
  `rank_port`) receives what decode sides send: a registration per decode NIXL agent (its
  agent metadata is loaded once: `add_remote_agent`; a second registration under the same
  name is ignored, as SGLang does), then per room a TransferInfo, and ABORTs. Its own thread
  decodes them (`messages.decode_from_decode`); undecodable frames are logged and dropped.
- One PUSH socket per decode endpoint `(ip, port)` (taken from the messages) carries
  KV_STATUS and ABORT_ACK back; `send_status` / `send_abort_ack` are thread-safe.

The data plane (what to WRITE) is `prefill_plan`; the caller owns rooms and WRITEs.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable

import zmq

from decode_worker.errors import TransferError
from decode_worker.io.kv.nixl_agent import NixlAgent
from decode_worker.io.kv.sglang import messages as m
from decode_worker.io.kv.sglang.frames import (
    Abort,
    AbortAck,
    FrameError,
    KVStatus,
    Registration,
    TransferInfo,
)

log = logging.getLogger(__name__)
PREFILL_RANK = 0  # attn_tp_rank * (pp * cp) + pp_rank * cp + cp_rank, all 0 here
Endpoint = tuple[str, int]


def advertised_ip(host: str) -> str:
    """The address decode sides reach a socket bound to `host` at: `host` itself, or for a
    wildcard bind this machine's address (as SGLang's `get_local_ip_auto`)."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class RankChannel:
    """Serve one rank's PULL socket on tcp://host:port (0: any free port) until `close()`.

    `on_info` / `on_abort` run on the channel's thread for each TransferInfo / ABORT; they
    must not block. Raises TransferError if the port cannot be bound.
    """

    def __init__(
        self, host: str, port: int, agent: NixlAgent,
        on_info: Callable[[TransferInfo], None], on_abort: Callable[[Abort], None],
        poll_ms: int = 20,
    ) -> None:  # fmt: skip
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.IPV6, int(":" in host))
        url = f"tcp://[{host}]" if ":" in host else f"tcp://{host or '0.0.0.0'}"
        try:
            if port:
                self._pull.bind(f"{url}:{port}")
                self.port = port
            else:
                self.port = self._pull.bind_to_random_port(url)
        except zmq.ZMQError as exc:
            self._pull.close()
            self._ctx.term()
            raise TransferError(f"SGLang rank socket cannot bind {host}:{port}: {exc}") from None
        self._agent, self._on_info, self._on_abort = agent, on_info, on_abort
        self._poll_ms = poll_ms
        self._regs: dict[str, Registration] = {}
        self._regs_lock = threading.Lock()
        self._push: dict[Endpoint, zmq.Socket[bytes]] = {}
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="sglang-rank", daemon=True)
        self._thread.start()

    def registration(self, agent_name: str) -> Registration | None:
        """The registration of a decode agent, None if it never registered (thread-safe)."""
        with self._regs_lock:
            return self._regs.get(agent_name)

    def send_status(self, targets: Iterable[Endpoint], room: int, status: int,
                    reason: str = "") -> None:
        """KV_STATUS `status` (frames.Status) for `room` to each decode endpoint."""
        frames = m.encode_kv_status(KVStatus(room, status, PREFILL_RANK, reason))
        for ip, port in targets:
            self._send((ip, port), frames)

    def send_abort_ack(self, target: Endpoint, room: int, generation: int) -> None:
        self._send(target, m.encode_abort_ack(AbortAck(room, PREFILL_RANK, generation)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pull.close()
        with self._push_lock:
            for sock in self._push.values():
                sock.close()
            self._push.clear()
        self._ctx.term()

    def _send(self, target: Endpoint, frames: list[bytes]) -> None:
        """Queue one message on the endpoint's PUSH socket (created on first use); a decode
        side that does not read is logged, never waited for."""
        with self._push_lock:
            sock = self._push.get(target)
            if sock is None:
                sock = self._push[target] = self._connect(target)
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("sglang: cannot send %s to %s:%d: %s", frames[0][:12], *target, exc)

    def _connect(self, target: Endpoint) -> zmq.Socket[bytes]:
        ip, port = target
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(":" in ip))
        sock.connect(f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}")
        return sock

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._pull.poll(self._poll_ms, zmq.POLLIN):
                continue
            while True:
                try:
                    frames = self._pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._handle(frames)
                except FrameError as exc:
                    log.warning("sglang: dropped a message from a decode side: %s", exc)
                except Exception:  # loop boundary: one bad message never stops the channel
                    log.exception("sglang: handling a message from a decode side failed")

    def _handle(self, frames: list[bytes]) -> None:
        msg = m.decode_from_decode(frames)
        if isinstance(msg, Registration):
            self._register(msg)
        elif isinstance(msg, TransferInfo):
            self._on_info(msg)
        else:
            self._on_abort(msg)

    def _register(self, reg: Registration) -> None:
        """Load a new decode agent's metadata once; it is refused (logged) if NIXL rejects it
        or names another agent; its rooms then fail as unregistered."""
        with self._regs_lock:
            if reg.agent_name in self._regs:
                return
        try:
            name = self._agent.add_peer(reg.agent_metadata)
        except TransferError as exc:
            log.warning("sglang: decode agent %s refused: %s", reg.agent_name, exc)
            return
        if name != reg.agent_name:
            log.warning("sglang: registration names agent %s, its NIXL metadata %s: refused",
                        reg.agent_name, name)  # fmt: skip
            self._agent.remove_peer(name)
            return
        with self._regs_lock:
            self._regs[name] = reg
        log.info("sglang: decode agent %s registered (%s:%d, tp %d, %d KV entries)", name,
                 reg.ip, reg.port, reg.tp_size, len(reg.kv_ptrs))  # fmt: skip
