"""What both aux buffers share: ours (`aux_buffer.AuxBuffer`) and SGLang's ten buffers
(`sglang_aux.SglangAuxBuffers`). Each is host rows, one per transfer in flight, where a prefill
writes a request's first output token beside the room it belongs to (the decode side checks
that the row names its own room). The row layouts differ; the shell does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from decode_worker.core.sampling import TopLogprobs

ROOM_MASK = 2**64 - 1  # rooms are unsigned 64-bit; the rows store them as int64


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One row as read: the room it names (unsigned), the first output token, its logprob and
    the most likely alternatives."""

    room: int
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs


class AuxRows:
    """`num_rows` rows in host memory (DRAM, even when the pools are on a GPU). Not
    thread-safe: one owner. Raises ValueError unless `num_rows` is positive."""

    def __init__(self, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError("num_rows must be positive")
        self.num_rows = num_rows


def room_to_i64(room: int) -> int:
    """A room as the int64 a row stores (bit for bit)."""
    room &= ROOM_MASK
    return room - 2**64 if room >= 2**63 else room
