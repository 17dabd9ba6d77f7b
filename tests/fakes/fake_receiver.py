"""`FakeReceiver`: the KV receiver's owner API with no prefill peer behind it (tests only).

A transfer a test posts goes nowhere: `submit` records it, and it ends only with the events the
test queues (`queue`: "done", "failed", "released"), which `take_events` hands to the request
table as the real receiver would. An abort is recorded, and acknowledged ("released") only when
the test queues it, as a peer that stops writing later would.
"""

from __future__ import annotations

from typing import Any

from decode_worker.io.kv.peer import TransferEvent


class FakeReceiver:
    """Records submits (ids from `first_id` on) and aborts; hands out the events queued."""

    def __init__(self, first_id: int = 1) -> None:
        self.submitted: dict[int, dict[str, Any]] = {}
        self.aborted: list[int] = []
        self.events: list[TransferEvent] = []
        self._first_id = first_id

    def submit(self, host: str, port: int, **kw: Any) -> int:
        tid = self._first_id + len(self.submitted)
        self.submitted[tid] = kw
        return tid

    def take_events(self) -> list[TransferEvent]:
        out, self.events = self.events, []
        return out

    def abort_transfer(self, transfer_id: int) -> None:
        self.aborted.append(transfer_id)

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None:
        pass

    def queue(self, kind: str, tid: int, **fields: Any) -> None:
        """Transfer `tid` reports `kind` at the next `take_events`."""
        kw = self.submitted[tid]
        self.events.append(TransferEvent(kind, tid, kw["rid"], kw["room"], **fields))  # type: ignore[arg-type]
