"""The aux buffer: small host rows of per-request transfer metadata (the first output token).

One row is 64 bytes (the RDMA minimum) of eight int64 slots:

    slot  0: room echo (the corruption check: the row must name the room that owns it)
          1: first output token id
          2: its logprob (a float64 stored bit for bit)
          3: ready flag (1 once the prefill side wrote the row)
          4: transfer id
          5..7: reserved (0)

The prefill side fills a row of its own buffer and WRITEs it over the decode side's row in the
same NIXL transfer group as the KV, so the row lands before that transfer's notification.
Always in DRAM, even when the pools are on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_worker.core.types import MemoryRegion

ROW_SLOTS = 8
ROW_BYTES = ROW_SLOTS * 8
_ROOM, _TOKEN, _LOGPROB, _READY, _TRANSFER = range(5)


@dataclass(frozen=True, slots=True)
class AuxRow:
    room: int
    token_id: int
    logprob: float
    ready: bool
    transfer_id: int


class AuxBuffer:
    """`num_rows` rows in one pinned-if-possible host tensor. Not thread-safe: one owner."""

    def __init__(self, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError("num_rows must be positive")
        self.num_rows = num_rows
        self.rows = torch.zeros(num_rows, ROW_SLOTS, dtype=torch.int64)  # rows: [n, 8] i64

    def memory_region(self) -> MemoryRegion:
        return MemoryRegion(self.rows.data_ptr(), self.num_rows * ROW_BYTES, 0, "DRAM")

    def write(self, slot: int, room: int, token_id: int, logprob: float, transfer_id: int) -> None:
        """Fill row `slot` (room wrapped to int64) and set its ready flag."""
        lp = torch.tensor([logprob], dtype=torch.float64).view(torch.int64)  # lp: [1] i64
        self.rows[slot] = 0
        self.rows[slot, _ROOM] = _to_i64(room)
        self.rows[slot, _TOKEN] = token_id
        self.rows[slot, _LOGPROB] = lp[0]
        self.rows[slot, _TRANSFER] = transfer_id
        self.rows[slot, _READY] = 1

    def read(self, slot: int) -> AuxRow:
        row = self.rows[slot].clone()  # row: [8] i64
        logprob = float(row[_LOGPROB : _LOGPROB + 1].view(torch.float64)[0])
        return AuxRow(
            room=int(row[_ROOM]) & (2**64 - 1),
            token_id=int(row[_TOKEN]),
            logprob=logprob,
            ready=bool(row[_READY]),
            transfer_id=int(row[_TRANSFER]),
        )

    def check(self, slot: int, room: int, transfer_id: int) -> AuxRow | None:
        """The row if it is ready and names this room and transfer, else None."""
        row = self.read(slot)
        if row.ready and row.room == room & (2**64 - 1) and row.transfer_id == transfer_id:
            return row
        return None

    def clear(self, slot: int) -> None:
        """Zero a row before handing its slot to a new transfer."""
        self.rows[slot] = 0


def _to_i64(value: int) -> int:
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value
