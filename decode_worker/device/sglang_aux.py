"""SGLang's aux ("metadata") buffers on the decode side: where an SGLang prefill writes a
request's first output token, its logprob and top logprobs, and the room as the landed flag.

SGLang 0.5.23's default schema (no speculative decoding, no sampling mask, no KV checksum): ten
positional buffers of one row per request; the prefill writes row r of each of its buffers to
row r of ours (`addr_i + row * row_bytes_i`), for i < min(its count, ours).

    i  name                        dtype x width   row bytes  used
    0  output_ids                  int32 x 16      64         [0] first output token
    1  cached_tokens               int32 x 16      64         [0] prefill-side cached tokens
    2  output_token_logprobs_val   float32 x 16    64         [0] its logprob
    3  output_token_logprobs_idx   int32 x 16      64         [0] its id
    4  output_top_logprobs_val     float32 x 128   512        [:n] top logprobs
    5  output_top_logprobs_idx     int32 x 128     512        [:n] their ids
    6  output_topk_p               float32 x 16    64         speculative decoding only
    7  output_topk_index           int64 x 16      128        speculative decoding only
    8  output_hidden_states        float32 x 16    64         speculative decoding only
    9  bootstrap_room              uint64 x 8      64         [0] room (0 = not landed)

The number of top logprobs is not on the wire: the decode side knows it from its request.
Host rows like our own aux buffer's (`aux_rows.AuxRows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode_worker.core.types import MemoryRegion
from decode_worker.device.aux_rows import ROOM_MASK, AuxRows, FirstToken, room_to_i64

# (dtype, width) per buffer, in SGLang's order
SCHEMA: tuple[tuple[torch.dtype, int], ...] = (
    (torch.int32, 16), (torch.int32, 16), (torch.float32, 16), (torch.int32, 16),
    (torch.float32, 128), (torch.int32, 128), (torch.float32, 16), (torch.int64, 16),
    (torch.float32, 16), (torch.int64, 8),  # uint64 on SGLang's side: the same 8 bytes
)
_IDS, _CACHED, _LP_VAL, _LP_IDX, _TOP_VAL, _TOP_IDX, _ROOM = 0, 1, 2, 3, 4, 5, 9


@dataclass(frozen=True, slots=True)
class SglangAuxRow(FirstToken):
    cached_tokens: int


class SglangAuxBuffers(AuxRows):
    """`num_rows` rows of SGLang's ten aux buffers (see the module docstring)."""

    def __init__(self, num_rows: int) -> None:
        super().__init__(num_rows)
        # buffers[i]: [num_rows, width_i] of SCHEMA[i]'s dtype
        self.buffers = [torch.zeros(num_rows, width, dtype=dtype) for dtype, width in SCHEMA]

    def regions(self) -> list[tuple[MemoryRegion, int]]:
        """Each buffer's memory and its row bytes, in SGLang's order (for registration)."""
        return [(MemoryRegion(b.data_ptr(), b.numel() * b.element_size(), 0, "DRAM"),
                 b.shape[1] * b.element_size()) for b in self.buffers]

    def read(self, row: int, num_top: int) -> SglangAuxRow:
        """Row `row`, with the `num_top` (at most 128) most likely alternatives."""
        b, n = self.buffers, max(0, min(num_top, SCHEMA[_TOP_VAL][1]))
        top_ids = b[_TOP_IDX][row, :n].tolist()
        top_vals = b[_TOP_VAL][row, :n].tolist()
        return SglangAuxRow(
            room=int(b[_ROOM][row, 0]) & ROOM_MASK,
            token_id=int(b[_IDS][row, 0]),
            logprob=float(b[_LP_VAL][row, 0]),
            top_logprobs=list(zip(top_ids, top_vals, strict=True)),
            cached_tokens=int(b[_CACHED][row, 0]),
        )

    def check(self, row: int, room: int, num_top: int) -> SglangAuxRow | None:
        """The row if it landed for this room (SGLang's own check: the room field), else None."""
        got = self.read(row, num_top)
        return got if got.room == room & ROOM_MASK and room != 0 else None

    def write(self, row: int, room: int, token_id: int, logprob: float,
              top_logprobs: Sequence[tuple[int, float]] = (), cached_tokens: int = 0) -> None:
        """Fill row `row` as an SGLang prefill does (for the prefill side and tests)."""
        b, top = self.buffers, list(top_logprobs)[: SCHEMA[_TOP_VAL][1]]
        self.clear(row)
        b[_IDS][row, 0], b[_LP_IDX][row, 0] = token_id, token_id
        b[_LP_VAL][row, 0], b[_CACHED][row, 0] = logprob, cached_tokens
        if top:
            b[_TOP_IDX][row, : len(top)] = torch.tensor([t for t, _ in top], dtype=torch.int32)
            b[_TOP_VAL][row, : len(top)] = torch.tensor([v for _, v in top], dtype=torch.float32)
        b[_ROOM][row, 0] = room_to_i64(room)

    def clear(self, row: int) -> None:
        """Zero a row before it serves a new transfer (the room reads 0: not landed)."""
        for buf in self.buffers:
            buf[row] = 0
