"""One attention-TP rank of the synthetic SGLang prefill node (venv-only; see README.md).

Everything on the wire is SGLang's own code: a `NixlKVManager(PREFILL)` over a real
`SWAKVPool` and `MetadataBuffers`, one `NixlKVSender` per room, pages handed to `send` the way
`SchedulerDisaggregationPrefillMixin._send_kv_chunk` hands them (non-last chunks cut to whole
pages, the last chunk with `set_buf` and the SWA window's state indices). The model forward is
forward.py's: the synthetic `kv_bits`, or with `--model` the real prefill of a Hugging Face
directory (`kv: "model"` rooms).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import sglang_cpu
import torch
from forward import ModelForward, Slots, seeded_aux, write_seeded
from layout import Layout

logger = logging.getLogger("prefill_rank")

_STATUS = {0: "failed", 1: "bootstrapping", 2: "waiting_for_input", 3: "transferring",
           4: "success"}
FAIL_MODES = ("status", "state_mismatch", "abort", "die")


class PrefillRank:
    """Pools, metadata rows and the NIXL manager of one prefill rank; rooms run on threads."""

    def __init__(self, layout: Layout, tp_rank: int, bootstrap_port: int,
                 host: str, seed: int, model_dir: str | None = None) -> None:
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

        self.layout, self.tp_rank, self.seed, self.host = layout, tp_rank, seed, host
        self.bootstrap_port = bootstrap_port
        self.server_args = sglang_cpu.publish_server_args("prefill", layout, bootstrap_port,
                                                          tp_rank, host)
        sglang_cpu.install_workarounds()
        sglang_cpu.record_route_puts()
        self.pool = sglang_cpu.build_pool(layout)
        self.metadata = sglang_cpu.build_metadata(layout, self.server_args)
        self.kv_args = sglang_cpu.build_kv_args("prefill", layout, self.pool, self.metadata,
                                                tp_rank)
        self.manager = sglang_cpu.build_manager("prefill", self.kv_args, self.server_args)
        self.rows = ReqToMetadataIdxAllocator(layout.metadata_rows)
        # scattered page ids, like a warm allocator; the same on every rank, as SGLang's TP ranks
        # allocate in lockstep
        rng = random.Random(1000)
        full = list(range(1, layout.pool_tokens // layout.page_size + 1))
        swa = list(range(1, layout.swa_pool_tokens // layout.page_size + 1))
        rng.shuffle(full)
        rng.shuffle(swa)
        self.free_full, self.free_swa = deque(full), deque(swa)
        self.lock = threading.Lock()
        self.rooms: dict[int, dict[str, Any]] = {}
        first_head = tp_rank * layout.heads_per_rank
        self.heads = np.arange(first_head, first_head + layout.heads_per_rank)
        self.model = ModelForward(model_dir, layout) if model_dir else None
        self._count_decode_aborts()

    def _count_decode_aborts(self) -> None:
        """Count the decode side's ABORTs per room (`decode_aborts` in the room's state): SGLang
        handles each on its bootstrap thread through this method of the manager's, marking an
        unfinished room Failed with "Aborted by decode-side abort notification." as its cause."""
        from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

        handle = self.manager._handle_abort_notification  # sees every message: ABORTs only

        def counted(msg: list[bytes]) -> bool:
            is_abort = bool(msg) and msg[0] == ABORT_TAG
            notification = AbortNotification.from_zmq(msg) if is_abort else None
            if notification is not None:
                with self.lock:
                    state = self.rooms.get(notification.room)
                    if state is not None:
                        state["decode_aborts"] = state.get("decode_aborts", 0) + 1
            return bool(handle(msg))

        self.manager._handle_abort_notification = counted

    # ---- control --------------------------------------------------------------------------
    def start_room(self, spec: dict[str, Any]) -> None:
        room = int(spec["room"])
        with self.lock:
            self.rooms[room] = {"status": "accepted", "reason": None, "rank": self.tp_rank}
        threading.Thread(target=self._run_room, args=(spec,), daemon=True,
                         name=f"room-{room}").start()

    def room_state(self, room: int) -> dict[str, Any] | None:
        with self.lock:
            state = self.rooms.get(room)
            return dict(state) if state is not None else None

    def info(self) -> dict[str, Any]:
        return {"tp_rank": self.tp_rank, "rank_port": self.manager.rank_port,
                "kv_item_lens": list(self.kv_args.kv_item_lens),
                "state_item_lens": [list(x) for x in self.kv_args.state_item_lens],
                "aux_item_lens": list(self.kv_args.aux_item_lens),
                "kv_cache_dtype": self.kv_args.kv_cache_dtype_str}

    def _set(self, room: int, **values: Any) -> None:
        with self.lock:
            self.rooms[room].update(values)

    # ---- one room ---------------------------------------------------------------------------
    def _run_room(self, spec: dict[str, Any]) -> None:
        room = int(spec["room"])
        try:
            self._serve_room(spec)
        except Exception as exc:  # the room's thread boundary: report, keep serving others
            logger.exception("room %s failed in the prefill server", room)
            self._set(room, status="error", reason=f"{type(exc).__name__}: {exc}")

    def _serve_room(self, spec: dict[str, Any]) -> None:
        room, input_ids = int(spec["room"]), list(spec["input_ids"])
        slots = self._allocate(room, len(input_ids))
        try:
            aux = self._forward(spec, input_ids, slots)
            self._transfer(room, spec, slots, aux)
        finally:
            # concluded (or given up) by now: the transfer worker no longer reads these
            row = (self.room_state(room) or {}).get("metadata_row")
            if row is not None:
                self.metadata.clear_slot(row)
                self.rows.free(row)
            self._free(slots)

    def _transfer(self, room: int, spec: dict[str, Any], slots: Slots,
                  aux: dict[str, Any]) -> None:
        """Bootstrap with the decode, then fail as asked or send every chunk; the room's end."""
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.nixl.conn import NixlKVSender

        timeout_s, fail = float(spec.get("timeout_s", 60.0)), spec.get("fail")
        if self.tp_rank not in spec.get("fail_ranks", [self.tp_rank]):
            fail = None  # only the ranks named fail; the others serve (after `delay_s`)
        sender = NixlKVSender(mgr=self.manager,
                              bootstrap_addr=f"{self.host}:{self.bootstrap_port}",
                              bootstrap_room=room)
        status = self._wait(sender, {KVPoll.WaitingForInput}, timeout_s)
        if status != KVPoll.WaitingForInput:
            return self._conclude(room, sender, status)
        if fail == "die":
            logger.warning("room %s: dying on request (fail=die)", room)
            os._exit(17)
        if fail == "abort":  # SGLang's prefill-side abort: marks Failed, tells no one
            sender.abort()
            return self._conclude(room, sender, sender.poll())
        if fail == "status":  # what the transfer worker does on a NIXL/transport error
            self.manager.conclude_failure(
                bootstrap_room=room,
                failure_reason=spec.get("fail_reason") or "synthetic prefill failure")
            return self._conclude(room, sender, self._wait(sender, set(), timeout_s))
        time.sleep(float(spec.get("delay_s", 0.0)))
        self._send_chunks(sender, spec, slots, aux, mismatch=fail == "state_mismatch")
        self._conclude(room, sender, self._wait(sender, set(), timeout_s))

    def _wait(self, sender: Any, until: set[int], timeout_s: float) -> int:
        """Poll like the scheduler does; returns at a terminal status, `until`, or timeout."""
        deadline = time.monotonic() + timeout_s
        room = sender.bootstrap_room
        while True:
            status = sender.poll()
            self._set(room, status=_STATUS.get(int(status), str(status)))
            if status in until or status in (0, 4) or time.monotonic() > deadline:
                return int(status)
            time.sleep(0.002)

    def _conclude(self, room: int, sender: Any, status: int) -> None:
        from sglang.srt.disaggregation.common.conn import KVTransferError

        if status == 4:
            sender.clear()
            self._set(room, status="success")
        elif status == 0:
            try:
                sender.failure_exception()
            except KVTransferError as exc:
                self._set(room, status="failed", reason=str(exc))
        else:
            sender.abort()
            sender.clear()
            self._set(room, status="timeout", reason=f"stuck in {_STATUS.get(status)}")

    # ---- the forward and the sends ----------------------------------------------------------
    def _allocate(self, room: int, seq_len: int) -> Slots:
        """Pages for [0, L) (full) and SGLang's SWA window [floor_ps(L - window), L) (SWA)."""
        lay, ps = self.layout, self.layout.page_size
        num_pages = -(-seq_len // ps)
        swa_start = max(0, seq_len - lay.swa_window) // ps * ps  # floor_ps(L - window)
        num_swa_pages = num_pages - swa_start // ps
        with self.lock:
            if len(self.free_full) < num_pages or len(self.free_swa) < num_swa_pages:
                raise RuntimeError(f"room {room}: prefill pool exhausted")
            full_pages = [self.free_full.popleft() for _ in range(num_pages)]
            swa_pages = [self.free_swa.popleft() for _ in range(num_swa_pages)]
        offsets = torch.arange(ps, dtype=torch.int32)
        full_slots = (torch.tensor(full_pages, dtype=torch.int32)[:, None] * ps
                      + offsets).flatten()[:seq_len]  # [L] i32
        swa_slots = torch.full((seq_len,), -1, dtype=torch.int32)  # [L] i32
        swa_slots[swa_start:] = (torch.tensor(swa_pages, dtype=torch.int32)[:, None] * ps
                                 + offsets).flatten()[: seq_len - swa_start]
        return Slots(full_slots, swa_slots, swa_start)

    def _forward(self, spec: dict[str, Any], input_ids: list[int],
                 slots: Slots) -> dict[str, Any]:
        """Fill the room's KV (`kv`: "seeded" or "model"); the metadata-row fields."""
        if spec.get("kv", "seeded") == "model":
            if self.model is None:
                raise RuntimeError("kv 'model' needs the server started with --model DIR")
            return self.model.fill(self.pool, self.layout, self.heads, slots, input_ids, spec)
        write_seeded(self.pool, self.layout, self.heads, int(spec.get("seed", self.seed)), slots)
        return seeded_aux(spec)

    def _send_chunks(self, sender: Any, spec: dict[str, Any], slots: Slots,
                     aux: dict[str, Any], mismatch: bool = False) -> None:
        """Send the room's KV in chunks; `mismatch`: one SWA page more than the decode asked
        for (SGLang's transfer worker then fails the room itself)."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.mem_cache.common import kv_to_page_indices, kv_to_page_num

        room, ps, seq_len = sender.bootstrap_room, self.layout.page_size, len(slots.full)
        full_slots, swa_slots = slots.full, slots.swa
        prefix_len = sender.pop_decode_prefix_len()  # finalize_bootstrap
        row = self.rows.alloc()
        if row is None:
            raise RuntimeError(f"room {room}: no free metadata row")
        self._set(room, decode_prefix_len=prefix_len, metadata_row=row)
        sender.init(kv_to_page_num(seq_len - prefix_len, ps), row)
        chunk = int(spec.get("chunk_tokens") or seq_len)
        start = prefix_len
        for extend_end in range(chunk, seq_len, chunk):  # non-last chunks
            end = extend_end - extend_end % ps
            if end < start:
                continue
            pages = kv_to_page_indices(full_slots[start:end], ps)
            if sender.should_send_kv_chunk(len(pages), False):
                sender.send(pages, None, num_kv_tokens=end - start)
            start = end
        self.metadata.set_buf(sglang_cpu.aux_request(room, row, **aux))
        window_start = max(prefix_len, seq_len - self.layout.swa_window) // ps * ps
        swa_pages = kv_to_page_indices(swa_slots[window_start:seq_len], ps)
        if mismatch:
            swa_pages = np.append(swa_pages, swa_pages[-1:])
        state_indices = [swa_pages if st == StateType.SWA else None
                         for st in self.kv_args.state_types] or None  # None: no state pools
        pages = kv_to_page_indices(full_slots[start:seq_len], ps)
        self._set(room, num_pages_sent=sender.curr_idx + len(pages),
                  num_swa_pages_sent=len(swa_pages))
        sender.send(pages, state_indices, num_kv_tokens=seq_len - start)

    def _free(self, slots: Slots) -> None:
        ps = self.layout.page_size
        with self.lock:
            self.free_full.extend(int(s) // ps for s in slots.full[::ps])
            self.free_swa.extend(int(s) // ps for s in slots.swa[::ps] if s >= 0)
