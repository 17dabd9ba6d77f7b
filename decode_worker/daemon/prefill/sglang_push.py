"""The SGLang-protocol prefill pipeline: prefill a started room into our own pools, stage its
aux row in SGLang's 10-buffer schema, post the NIXL WRITEs of every TransferInfo of the room
(`io.kv.sglang.prefill_plan`), and while they fly take the next room.

A room's source pages and staged aux row stay held until `reap` sees all its WRITEs DONE,
failed, or past the deadline; then `finish(room, result, outcome)` answers it. Compute thread
only (`SglangPrefillPeer` runs it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from decode_worker.core.types import MemoryRegion
from decode_worker.daemon.prefill.push import first_token
from decode_worker.daemon.prefill.sglang_state import Room
from decode_worker.daemon.prefill.state import PageFreeList, PrefillResult
from decode_worker.device.runner import ModelRunner
from decode_worker.device.sampler import Sampler
from decode_worker.errors import OutOfPages, TransferError
from decode_worker.io.kv.nixl_agent import NixlAgent, XferHandle
from decode_worker.io.kv.sglang.frames import Registration
from decode_worker.io.kv.sglang.prefill_plan import (
    AUX_ROW_BYTES,
    Geometry,
    Plan,
    SourceRoom,
    aux_row_bytes,
    plan_room,
)
from decode_worker.utils.mathx import cdiv

# landed: every WRITE DONE; failed: one ended in ERR (all settled); stuck: still in flight at
# the deadline (released anyway; the decode side is not told its pages are free)
Outcome = Literal["landed", "failed", "stuck"]
Finish = Callable[[Room, PrefillResult, Outcome], None]
Lookup = Callable[[str], Registration | None]


class AuxStaging:
    """Host rows of `AUX_ROW_BYTES` we WRITE SGLang's aux buffers from (registered DRAM)."""

    def __init__(self, num_rows: int) -> None:
        self.rows = torch.zeros(num_rows, AUX_ROW_BYTES, dtype=torch.uint8)  # [n, 1600] u8

    def memory_region(self) -> MemoryRegion:
        return MemoryRegion(self.rows.data_ptr(), self.rows.numel(), 0, "DRAM")

    def write(self, row: int, data: bytes) -> int:
        """Fill one row; returns its address."""
        self.rows[row] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return int(self.rows[row].data_ptr())


@dataclass
class _Push:
    room: Room
    handles: list[XferHandle]
    pages: tuple[list[int], list[int]]
    aux_row: int
    result: PrefillResult
    deadline: float


class SglangPushPipeline:
    """Prefill-and-WRITE of the rooms `SglangPrefillPeer` started, several in flight at once.
    `geometry` describes our pools, `registration` finds a decode agent's registration,
    `agent` has our pools and `staging` registered."""

    def __init__(
        self, runner: ModelRunner, geometry: Geometry, staging: AuxStaging, agent: NixlAgent,
        registration: Lookup, finish: Finish, deadline_s: float,
    ) -> None:  # fmt: skip
        self.runner, self.geometry, self.staging, self.agent = runner, geometry, staging, agent
        self.registration, self._finish, self.deadline_s = registration, finish, deadline_s
        self.sampler = Sampler(runner.device)
        self._free = PageFreeList(runner.pools.num_pages["full"], runner.pools.num_pages["swa"],
                                  runner.has_swa)
        self._aux_rows = list(range(staging.rows.shape[0]))
        self._pushes: list[_Push] = []

    def is_busy(self) -> bool:
        return bool(self._pushes)

    def post(self, room: Room) -> None:
        """Prefill `room` and post its WRITEs. Raises DecodeWorkerError (nothing held, nothing
        in flight) when it cannot: too few pages, a model error, a TransferInfo this prefill
        cannot serve (SGLang's reason text where it has one), a WRITE that fails to post."""
        self._pushes.append(self._prefill_and_post(room))

    def reap(self, now: float) -> None:
        """Finish every push whose WRITEs all settled, or that is past its deadline."""
        for push in list(self._pushes):
            states = [self.agent.state(h) for h in push.handles]
            stuck = "PROC" in states
            if stuck and now < push.deadline:
                continue
            self._pushes.remove(push)
            for handle in push.handles:
                self.agent.release(handle)
            self._free.give(*push.pages)
            self._aux_rows.append(push.aux_row)
            outcome: Outcome = "stuck" if stuck else "failed" if "ERR" in states else "landed"
            self._finish(push.room, push.result, outcome)

    def _take_pages(self, n_pages: int) -> tuple[list[int], list[int]]:
        while True:
            try:
                return self._free.take(n_pages)
            except OutOfPages:
                if not self._pushes:
                    raise
                self.reap(time.monotonic())
                time.sleep(0.0005)

    def _prefill_and_post(self, room: Room) -> _Push:
        prompt = room.prompt or []
        full_ids, swa_ids = self._take_pages(cdiv(len(prompt), self.geometry.page_size))
        row = self._aux_rows.pop()
        try:
            logits = self.runner.prefill(prompt, full_ids, swa_ids)  # logits: [V] f32
            token, logprob, top = first_token(self.sampler, logits, room.sampling)
            addr = self.staging.write(row, aux_row_bytes(room.room, token, logprob, top))
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            src = SourceRoom(len(prompt), full_ids, swa_ids, addr)
            plans = [(info.agent_name, self._plan(src, info.agent_name, room))
                     for info in room.infos.values() if not info.is_dummy]
            handles = self._post_all(plans)
        except BaseException:
            self._free.give(full_ids, swa_ids)
            self._aux_rows.append(row)
            raise
        num_bytes = sum(s.length for _, plan in plans for _, spans in plan for s in spans)
        result = PrefillResult(room.room, token, logprob, num_bytes, None, top)
        return _Push(room, handles, (full_ids, swa_ids), row, result,
                     time.monotonic() + self.deadline_s)

    def _plan(self, src: SourceRoom, agent_name: str, room: Room) -> Plan:
        reg = self.registration(agent_name)
        if reg is None:
            raise TransferError(f"decode agent {agent_name} has not registered with this "
                                "prefill rank (did the prefill restart?)")  # fmt: skip
        return plan_room(self.geometry, src, room.infos[agent_name], reg)

    def _post_all(self, plans: list[tuple[str, Plan]]) -> list[XferHandle]:
        """Post every WRITE (no notifications: SGLang completes by KV_STATUS). If one fails to
        post, wait for those already posted (bounded), then raise TransferError."""
        handles: list[XferHandle] = []
        try:
            for agent_name, plan in plans:
                for side, spans in plan:
                    handles.append(self.agent.post_write(agent_name, side, spans, b""))
        except TransferError:
            deadline = time.monotonic() + 5.0
            while any(self.agent.state(h) == "PROC" for h in handles) and (
                    time.monotonic() < deadline):  # fmt: skip
                time.sleep(0.001)
            for handle in handles:
                self.agent.release(handle)
            raise
        return handles
