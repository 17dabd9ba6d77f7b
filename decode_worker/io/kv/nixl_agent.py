"""A thin typed wrapper over one NIXL agent: registration, peers, WRITEs, notifications.

It sees only `MemoryRegion`s and integer descriptors `(addr, length, device_id)`, never tensors.
All calls take one lock: the NIXL agent is not promised to be thread-safe, and the prefill peer
uses it from its bootstrap thread (peers) and its compute thread (WRITEs).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from decode_worker.core.types import MemoryRegion
from decode_worker.errors import ConfigError, TransferError

log = logging.getLogger(__name__)

Desc = tuple[int, int, int]  # (addr, length, device_id)
_REGISTER_FIX = {
    "VRAM": "GPU pools need a NIXL backend built with CUDA support (UCX with its cuda "
            "transports; check `ucx_info -d`), or set model.device = 'cpu'",
    "DRAM": "host memory must be lockable for RDMA (ulimit -l unlimited / LimitMEMLOCK=infinity)",
}
XferState = Literal["DONE", "PROC", "ERR"]


@dataclass(frozen=True, slots=True)
class CopySpan:
    """One byte range to copy: `length` bytes from `src_addr` (ours) to `dst_addr` (peer's)."""

    src_addr: int
    dst_addr: int
    length: int


@dataclass(frozen=True, slots=True)
class WriteSide:
    """Memory kind and device of both ends of one WRITE (one NIXL descriptor list each)."""

    src_kind: str
    src_device: int
    dst_kind: str
    dst_device: int


def coalesce(spans: Iterable[CopySpan]) -> list[CopySpan]:
    """Merge each span into the previous one when both its source and its destination continue
    exactly where the previous one ended (a run of consecutive pages on both sides becomes one
    descriptor). Order is kept; nothing is reordered to find more merges."""
    out: list[CopySpan] = []
    for span in spans:
        if span.length <= 0:
            continue
        if out:
            last = out[-1]
            if (
                last.src_addr + last.length == span.src_addr
                and last.dst_addr + last.length == span.dst_addr
            ):
                out[-1] = CopySpan(last.src_addr, last.dst_addr, last.length + span.length)
                continue
        out.append(span)
    return out


def unique_agent_name(role: str) -> str:
    """`role-host-pid-random`: agent names must be unique across every peer a node meets."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class XferHandle:
    """One posted WRITE; release it with `NixlAgent.release` once it is DONE or ERR."""

    __slots__ = ("handle", "num_bytes", "num_descriptors", "peer")

    def __init__(self, handle: Any, peer: str, num_bytes: int, num_descriptors: int) -> None:
        self.handle = handle
        self.peer = peer
        self.num_bytes = num_bytes
        self.num_descriptors = num_descriptors


class NixlAgent:
    """One NIXL agent named `name` with one backend (`transfer.backend`, UCX by default).

    Raises ConfigError when NIXL or the backend cannot be loaded.
    """

    def __init__(self, name: str, backend: str, progress_delay_us: int) -> None:
        """`progress_delay_us`: `transfer.progress_delay_us` (0 = NIXL's busy-polling default)."""
        self.name = name
        self.backend = backend
        self._lock = threading.Lock()
        try:
            self._agent = _new_agent(name, backend, progress_delay_us)
        except ImportError as exc:  # pragma: no cover - nixl is a hard dependency
            raise ConfigError(f"transfer.backend={backend!r}: no nixl: {exc}") from None
        except Exception as exc:  # NIXL raises plain exceptions from its C++ core
            raise ConfigError(f"transfer.backend={backend!r}: cannot start NIXL: {exc}") from None
        self._registered: list[Any] = []
        self._peers: set[str] = set()

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register each region with the backend (one NIXL registration per memory kind).

        Raises ConfigError naming the likely fix when the backend refuses (startup).
        """
        with self._lock:
            for kind in ("DRAM", "VRAM"):
                descs = [(r.addr, r.length, r.device_id, "") for r in regions if r.kind == kind]
                if not descs:
                    continue
                try:
                    self._registered.append(self._agent.register_memory(descs, kind))
                except Exception as exc:  # NIXL raises plain errors (NIXL_ERR_BACKEND)
                    raise ConfigError(
                        f"transfer.backend={self.backend!r} cannot register {len(descs)} {kind} "
                        f"regions ({sum(d[1] for d in descs)} B): {exc}; {_REGISTER_FIX[kind]}"
                    ) from None

    def metadata(self) -> bytes:
        """This agent's metadata blob, to send to a peer (includes registered memory)."""
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. Raises TransferError if rejected."""
        with self._lock:
            try:
                raw = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise TransferError(f"cannot load peer agent metadata: {exc}") from None
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if name in self._peers:
                self._peers.discard(name)
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as exc:
                    log.warning("removing NIXL peer %s: %s", name, exc)

    def post_write(
        self, peer: str, side: WriteSide, spans: Sequence[CopySpan], notif: bytes
    ) -> XferHandle:
        """Post one WRITE of `spans` (ours -> peer's) that delivers `notif` to the peer after the
        data. Raises TransferError if NIXL refuses to build or post it."""
        src = [(s.src_addr, s.length, side.src_device) for s in spans]
        dst = [(s.dst_addr, s.length, side.dst_device) for s in spans]
        with self._lock:
            try:
                local = self._agent.get_xfer_descs(src, side.src_kind)
                remote = self._agent.get_xfer_descs(dst, side.dst_kind)
                handle = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
                state = self._agent.transfer(handle)
            except Exception as exc:
                raise TransferError(f"NIXL WRITE to {peer} failed to post: {exc}") from None
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"NIXL WRITE to {peer} failed at post")
        return XferHandle(handle, peer, sum(s.length for s in spans), len(spans))

    def send_notif(self, peer: str, message: bytes) -> None:
        """A notification not bound to a WRITE. Raises TransferError if NIXL refuses it."""
        with self._lock:
            try:
                self._agent.send_notif(peer, message)
            except Exception as exc:
                raise TransferError(f"NIXL notification to {peer} failed: {exc}") from None

    def state(self, xfer: XferHandle) -> XferState:
        with self._lock:
            try:
                state: XferState = self._agent.check_xfer_state(xfer.handle)
            except Exception as exc:
                log.warning("NIXL state of a WRITE to %s: %s", xfer.peer, exc)
                return "ERR"
        return state

    def release(self, xfer: XferHandle) -> None:
        with self._lock:
            self._release(xfer.handle)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.warning("releasing a NIXL handle: %s", exc)

    def drain_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as (peer agent name, message)."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [(peer, bytes(m)) for peer, msgs in notifs.items() for m in msgs]

    def close(self) -> None:
        """Deregister memory and drop peers; the agent is unusable afterwards."""
        for name in list(self._peers):
            self.remove_peer(name)
        with self._lock:
            for reg in self._registered:
                try:
                    self._agent.deregister_memory(reg)
                except Exception as exc:
                    log.warning("deregistering NIXL memory: %s", exc)
            self._registered.clear()


_construct_lock = threading.Lock()


def _new_agent(name: str, backend: str, progress_delay_us: int) -> Any:
    """A nixl_agent whose progress thread sleeps up to `progress_delay_us` between polls.

    nixl's Python wrapper (1.5) hard-codes the C++ config's `pthrDelay` to 0: the progress
    thread spins a core even when idle. While the wrapper builds the agent, its bindings' agent
    constructor is wrapped to set the field; a wrapper without that hook builds it as nixl does.
    """
    import importlib

    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-untyped]

    config = nixl_agent_config(backends=[backend])
    bindings = getattr(importlib.import_module(nixl_agent.__module__), "nixlBind", None)
    real = getattr(bindings, "nixlAgent", None)
    if not progress_delay_us or bindings is None or real is None:
        return nixl_agent(name, config)

    def with_delay(agent_name: str, agent_config: Any) -> Any:
        if hasattr(agent_config, "pthrDelay"):
            agent_config.pthrDelay = progress_delay_us
        else:
            log.warning("nixl has no progress-thread delay: its progress thread busy-polls")
        return real(agent_name, agent_config)

    with _construct_lock:
        bindings.nixlAgent = with_delay
        try:
            return nixl_agent(name, config)
        finally:
            bindings.nixlAgent = real
