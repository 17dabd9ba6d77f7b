"""The shell both decode-side receivers share (`KVReceiver`, our native protocol, and
`SglangReceiver`, SGLang's): the NIXL agent they own or share, transfer ids, `submit` and
`abort_transfer` around the `TransferBook`, and a peer's queue of transfers waiting for it to be
ready. The wire formats differ; each receiver says how it finds the peer of a new transfer
(`_peer_for`) and how a transfer request goes out (`_send`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.nixl_agent import NixlAgent, unique_agent_name
from decode_worker.io.kv.peer import Transfer, register_regions
from decode_worker.io.kv.transfers import TransferBook

if TYPE_CHECKING:  # io/ takes the settings object but does not import pydantic at run time
    from decode_worker.settings import TransferSettings


class WaitingPeer(Protocol):
    """A prefill peer as the shell sees it: ready for requests, or holding their transfer ids
    until it is."""

    waiting: list[int]

    @property
    def ready(self) -> bool: ...


PeerT = TypeVar("PeerT", bound=WaitingPeer)


class ReceiverBase(ABC, Generic[PeerT]):
    """`agent`: a NixlAgent shared with another receiver (its owner registered `regions` and
    closes it); without one the receiver builds its own and registers `regions`. The subclass
    sets `_book`. Raises ConfigError if the NIXL agent cannot start."""

    _book: TransferBook

    def __init__(
        self, settings: TransferSettings, regions: dict[str, p.RegionLayout], kv_timeout_s: float,
        agent: NixlAgent | None, agent_name: str | None,
    ) -> None:  # fmt: skip
        self.settings, self.kv_timeout_s = settings, kv_timeout_s
        self._owns_agent = agent is None
        if agent is None:
            agent = NixlAgent(agent_name or unique_agent_name("decode"), settings.backend,
                              settings.progress_delay_us)  # fmt: skip
            register_regions(agent, regions)
        self.agent = agent
        self._next_id = 1

    # -- owner API -------------------------------------------------------------------------

    def submit(
        self, host: str, port: int, *, rid: str, room: int, prompt_len: int, reused_len: int,
        swa_window_start: int, full_page_ids: list[int], swa_page_ids: list[int],
        aux_row: int, timeout_s: float | None = None, prompt_ids: list[int] | None = None,
    ) -> int:  # fmt: skip
        """Ask the prefill peer at host:port (an SGLang prefill: its bootstrap server) for this
        request's KV; returns the transfer id. Argument meanings: docs/CONTRACTS.md (SGLang:
        `reused_len` is decode_prefix_len, `swa_window_start` SGLang's window start).
        `prompt_ids`: the native protocol sends the prompt too (when no router gives it to the
        peer over HTTP); SGLang's does not (the router gives SGLang the prompt).

        Never raises for a per-request problem: bad page ids, a dead or incompatible peer all
        come back as a "failed" then "released" event from `take_events()`.
        """
        tid, self._next_id = self._next_id, self._next_id + 1
        sent_prompt, kv_checksum = self._wire_extras(prompt_ids)
        req = p.TransferRequest(
            tid, room, rid, prompt_len, reused_len, swa_window_start, list(full_page_ids),
            list(swa_page_ids), aux_row, timeout_s or self.kv_timeout_s, sent_prompt, kv_checksum,
        )  # fmt: skip
        now = time.monotonic()
        xfer = self._book.add(req, f"{host}:{port}", now)
        peer = self._peer_for(xfer, host, port, now)
        if peer is None:
            return tid
        if peer.ready:
            self._send(peer, xfer, now)
        else:
            peer.waiting.append(tid)
        return tid

    def abort_transfer(self, transfer_id: int) -> None:
        """Stop waiting for this transfer. Its pages come back with a later "released" event,
        once the peer can no longer be writing into them."""
        self._book.abort(transfer_id, time.monotonic())

    @property
    def num_in_flight(self) -> int:
        return len(self._book)

    # -- for the subclass ------------------------------------------------------------------

    def _wire_extras(self, prompt_ids: list[int] | None) -> tuple[list[int] | None, bool]:
        """The request's `prompt_ids` and `kv_checksum` fields: none by default."""
        return None, False

    @abstractmethod
    def _peer_for(self, xfer: Transfer, host: str, port: int, now: float) -> PeerT | None:
        """The peer that serves the new transfer `xfer` (connecting it if need be), or None
        when `xfer` failed already (in the book)."""

    @abstractmethod
    def _send(self, peer: PeerT, xfer: Transfer, now: float) -> None:
        """Send `xfer`'s request to its ready peer (the transfer becomes "sent")."""

    def _send_waiting(self, peer: PeerT, now: float) -> None:
        """The peer became ready: send the transfers still queued for it."""
        waiting, peer.waiting = peer.waiting, []
        for tid in waiting:
            if (xfer := self._book.get(tid)) is not None and xfer.phase == "queued":
                self._send(peer, xfer, now)

    def _fail_peer(self, key: str, reason: str, detail: str, now: float) -> None:
        """Fail every transfer of the peer `key` (an aborting one keeps its quiesce clock);
        those never sent are acked at once, the sent ones wait for `abort_quiesce_s`."""
        for xfer in self._book.of_peer(key):
            if xfer.phase != "aborting":
                self._book.fail(xfer, reason, f"{key}: {detail}", now,
                                acked=xfer.phase == "queued")  # fmt: skip
