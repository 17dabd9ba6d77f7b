"""The aux buffer: small host rows of per-request transfer metadata (the first output token).

One row is 384 bytes: 48 int64 words.

    word  0: room echo (the corruption check: the row must name the room that owns it)
          1: first output token id
          2: its logprob (a float64 stored bit for bit)
          3: ready flag (1 once the prefill side wrote the row)
          4: transfer id
          5: how many top logprobs follow (0..MAX_TOP_LOGPROBS)
          6..7: reserved (0)
          8 + 2i, 9 + 2i: the i-th most likely token id and its logprob (float64 bits)

The prefill side fills a row of its own buffer and WRITEs it over the decode side's row in the
same NIXL transfer group as the KV, so the row lands before that transfer's notification.
Always in DRAM, even when the pools are on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode_worker.core.sampling import MAX_TOP_LOGPROBS
from decode_worker.core.types import MemoryRegion
from decode_worker.device.aux_rows import ROOM_MASK, AuxRows, FirstToken, room_to_i64

_HEAD = 8
ROW_WORDS = _HEAD + 2 * MAX_TOP_LOGPROBS
ROW_BYTES = ROW_WORDS * 8
_ROOM, _TOKEN, _LOGPROB, _READY, _TRANSFER, _NUM_TOP = range(6)


@dataclass(frozen=True, slots=True)
class AuxRow(FirstToken):
    ready: bool
    transfer_id: int


class AuxBuffer(AuxRows):
    """`num_rows` rows in one pinned-if-possible host tensor (`AuxRows`)."""

    def __init__(self, num_rows: int) -> None:
        super().__init__(num_rows)
        self.rows = torch.zeros(num_rows, ROW_WORDS, dtype=torch.int64)  # rows: [n, 48] i64

    def memory_region(self) -> MemoryRegion:
        return MemoryRegion(self.rows.data_ptr(), self.num_rows * ROW_BYTES, 0, "DRAM")

    def write(self, row: int, room: int, token_id: int, logprob: float, transfer_id: int,
              top_logprobs: Sequence[tuple[int, float]] = ()) -> None:
        """Fill row `row` (room wrapped to int64) and set its ready flag; at most
        MAX_TOP_LOGPROBS alternatives are kept."""
        top = list(top_logprobs)[:MAX_TOP_LOGPROBS]
        words = torch.zeros(ROW_WORDS, dtype=torch.int64)  # words: [48] i64
        words[_ROOM], words[_TOKEN], words[_TRANSFER] = room_to_i64(room), token_id, transfer_id
        words[_LOGPROB] = _f64_bits([logprob])[0]
        words[_NUM_TOP] = len(top)
        if top:
            words[_HEAD:_HEAD + 2 * len(top):2] = torch.tensor([t for t, _ in top])
            words[_HEAD + 1:_HEAD + 2 * len(top):2] = _f64_bits([lp for _, lp in top])
        words[_READY] = 1
        self.rows[row] = words

    def read(self, row: int) -> AuxRow:
        words = self.rows[row].clone()  # words: [48] i64
        n = min(max(int(words[_NUM_TOP]), 0), MAX_TOP_LOGPROBS)  # a corrupt count reads <= max
        pairs = words[_HEAD:_HEAD + 2 * n].view(n, 2)  # [n, 2]: token id, logprob bits
        top = list(zip(pairs[:, 0].tolist(),
                       pairs[:, 1].contiguous().view(torch.float64).tolist(), strict=True))
        return AuxRow(
            room=int(words[_ROOM]) & ROOM_MASK,
            token_id=int(words[_TOKEN]),
            logprob=float(words[_LOGPROB:_LOGPROB + 1].view(torch.float64)[0]),
            ready=bool(words[_READY]),
            transfer_id=int(words[_TRANSFER]),
            top_logprobs=top,
        )

    def check(self, row: int, room: int, transfer_id: int) -> AuxRow | None:
        """The row if it is ready and names this room and transfer, else None."""
        got = self.read(row)
        if got.ready and got.room == room & ROOM_MASK and got.transfer_id == transfer_id:
            return got
        return None

    def clear(self, row: int) -> None:
        """Zero a row before it serves a new transfer."""
        self.rows[row] = 0


def _f64_bits(values: list[float]) -> torch.Tensor:
    """float64 values as their int64 bit patterns (stored bit for bit)."""
    return torch.tensor(values, dtype=torch.float64).view(torch.int64)
