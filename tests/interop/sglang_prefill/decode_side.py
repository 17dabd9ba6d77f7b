"""SGLang 0.5.23's own decode side of a PD transfer, on the CPU (venv-only; see README.md).

A `NixlKVManager(DECODE)` over a real `SWAKVPool` and `MetadataBuffers`, one `NixlKVReceiver`
per room, driven as `DecodePreallocQueue` drives it: `try_ensure_parallel_info`, `init`, then
`send_metadata` with the page ids of `[decode_prefix_len, L)` and the SWA pages of SGLang's
window. Used by selfcheck.py (byte checks) and capture_frames.py (golden frames).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sglang_cpu
import torch
from layout import Layout, kv_bits

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
# (model layer, 0 = K / 1 = V, positions [n]) -> the KV a room should land: [n, kv_heads, head_dim]
ExpectedKV = Callable[[int, int, np.ndarray], torch.Tensor]


@dataclass
class Receipt:
    """One room as the decode side allocated it."""

    room: int
    seq_len: int
    prefix_len: int
    receiver: Any
    row: int
    full_pages: list[int]  # page of each prompt page, [0, L)
    swa_start: int  # first token of the SWA window the decode asked for
    swa_pages: list[int]  # pages of [swa_start, L)
    status: str = "waiting"
    reason: str | None = None
    times: dict[str, float] = field(default_factory=dict)


class DecodeSide:
    """One decode rank (attention TP 1: every KV head) with SGLang's decode-side classes."""

    def __init__(self, layout: Layout, bootstrap_addr: str, own_port: int) -> None:
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

        self.layout, self.bootstrap_addr = layout, bootstrap_addr
        self.server_args = sglang_cpu.publish_server_args("decode", layout, own_port)
        sglang_cpu.install_workarounds()
        self.pool = sglang_cpu.build_pool(layout, heads=layout.kv_heads)
        self.metadata = sglang_cpu.build_metadata(layout, self.server_args)
        self.kv_args = sglang_cpu.build_kv_args("decode", layout, self.pool, self.metadata, 0)
        self.manager = sglang_cpu.build_manager("decode", self.kv_args, self.server_args)
        self.rows = ReqToMetadataIdxAllocator(layout.metadata_rows)
        rng = random.Random(7)  # page ids unlike the prefill's
        full = list(range(1, layout.pool_tokens // layout.page_size + 1))
        swa = list(range(1, layout.swa_pool_tokens // layout.page_size + 1))
        rng.shuffle(full)
        rng.shuffle(swa)
        self.free_full, self.free_swa = deque(full), deque(swa)

    def connect(self, timeout_s: float = 60.0) -> None:
        """`try_ensure_parallel_info` until the prefill's bootstrap server has every rank."""
        deadline = time.monotonic() + timeout_s
        while not self.manager.try_ensure_parallel_info(self.bootstrap_addr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill at {self.bootstrap_addr} never became ready")
            time.sleep(0.2)

    def receive(self, room: int, seq_len: int, prefix_len: int = 0,
                swa_page_delta: int = 0) -> Receipt:
        """Allocate the room's pages and publish them to the prefill (`send_metadata`).

        `prefix_len` (page-aligned) is the decode radix-cache hit: only `[prefix_len, L)` is
        asked for. `swa_page_delta` asks for that many SWA pages more than SGLang's window.
        """
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

        lay, ps = self.layout, self.layout.page_size
        receiver = NixlKVReceiver(mgr=self.manager, bootstrap_addr=self.bootstrap_addr,
                                  bootstrap_room=room)
        receiver.init(0)  # prefill dp rank 0
        num_pages = -(-seq_len // ps)
        swa_start = max(prefix_len, seq_len - lay.swa_window) // ps * ps
        num_swa = num_pages - swa_start // ps + swa_page_delta
        full_pages = [self.free_full.popleft() for _ in range(num_pages)]
        swa_pages = [self.free_swa.popleft() for _ in range(num_swa)]
        row = self.rows.alloc()
        assert row is not None, "no free metadata row"
        kv_indices = np.array(full_pages[prefix_len // ps:], dtype=np.int32)
        state_indices = [np.array(swa_pages, dtype=np.int32) if st == StateType.SWA else None
                         for st in self.kv_args.state_types]
        receipt = Receipt(room, seq_len, prefix_len, receiver, row, full_pages, swa_start,
                          swa_pages, times={"sent": time.monotonic()})
        receiver.send_metadata(kv_indices, row, state_indices, decode_prefix_len=prefix_len)
        return receipt

    def wait(self, receipt: Receipt, timeout_s: float = 60.0) -> Receipt:
        """Poll until Success/Failed; a failure's reason is SGLang's `KVTransferError` text."""
        from sglang.srt.disaggregation.common.conn import KVTransferError

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = int(receipt.receiver.poll())
            if status == 4:
                receipt.status = "success"
                break
            if status == 0:
                try:
                    receipt.receiver.failure_exception()
                except KVTransferError as exc:
                    receipt.status, receipt.reason = "failed", str(exc)
                break
            time.sleep(0.002)
        else:
            receipt.status = "timeout"
        receipt.times["done"] = time.monotonic()
        return receipt

    def mismatches(self, receipt: Receipt, seed: int,
                   expected: ExpectedKV | None = None) -> list[str]:
        """Where the landed KV differs, bit for bit, from `expected` (default: `kv_bits` of
        `seed`); full layers over [prefix, L), SWA layers over the window."""
        lay, ps, problems = self.layout, self.layout.page_size, []
        for layer in range(lay.num_layers):
            is_swa = layer in lay.sliding_layer_ids
            first = receipt.swa_start if is_swa else receipt.prefix_len
            positions = np.arange(first, receipt.seq_len)
            if is_swa:
                pages = np.array(receipt.swa_pages)[(positions - receipt.swa_start) // ps]
            else:
                pages = np.array(receipt.full_pages)[positions // ps]
            slots = torch.from_numpy(pages * ps + positions % ps)
            for kind, buf in ((0, self.pool.get_key_buffer(layer)),
                              (1, self.pool.get_value_buffer(layer))):
                if expected is not None:
                    want = expected(layer, kind, positions)
                else:
                    want = torch.from_numpy(self._seeded(seed, layer, kind, positions, buf))
                ints = getattr(torch, _SIGNED[buf.element_size()].__name__)
                bad = np.argwhere((buf[slots].view(ints) != want.view(buf.dtype).view(ints))
                                  .numpy())
                if len(bad):
                    p, h, d = bad[0]
                    problems.append(f"layer {layer} {'KV'[kind]}: {len(bad)} values differ, "
                                    f"first at position {positions[p]} head {h} dim {d}")
        return problems

    def _seeded(self, seed: int, layer: int, kind: int, positions: np.ndarray,
                buf: torch.Tensor) -> np.ndarray:
        bits = kv_bits(seed, layer, kind, positions, np.arange(self.layout.kv_heads),
                       self.layout.head_dim, buf.element_size())
        return bits.view(_SIGNED[bits.itemsize])

    def aux_row(self, receipt: Receipt) -> dict[str, Any]:
        """The metadata row the prefill wrote, decoded as SGLang's decode reads it."""
        m, r = self.metadata, receipt.row
        return {"first_token": int(m.output_ids[r][0]),
                "cached_tokens": int(m.cached_tokens[r][0]),
                "logprob": float(m.output_token_logprobs_val[r][0]),
                "logprob_idx": int(m.output_token_logprobs_idx[r][0]),
                "top_logprobs_val": m.output_top_logprobs_val[r].tolist(),
                "top_logprobs_idx": m.output_top_logprobs_idx[r].tolist(),
                "bootstrap_room": int(m.bootstrap_room[r][0])}

    def release(self, receipt: Receipt) -> None:
        self.metadata.clear_slot(receipt.row)
        self.rows.free(receipt.row)
        self.free_full.extend(receipt.full_pages)
        self.free_swa.extend(receipt.swa_pages)
