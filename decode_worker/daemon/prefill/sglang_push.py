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
from decode_worker.daemon.prefill.sglang_state import Room
from decode_worker.daemon.prefill.shell import Held, PushShell
from decode_worker.daemon.prefill.state import PrefillResult
from decode_worker.device.runner import ModelRunner
from decode_worker.errors import TransferError
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
    held: Held
    result: PrefillResult
    deadline: float


class SglangPushPipeline(PushShell[_Push]):
    """Prefill-and-WRITE of the rooms `SglangPrefillPeer` started, several in flight at once.
    `geometry` describes our pools, `registration` finds a decode agent's registration,
    `agent` has our pools and `staging` registered."""

    def __init__(
        self, runner: ModelRunner, geometry: Geometry, staging: AuxStaging, agent: NixlAgent,
        registration: Lookup, finish: Finish, deadline_s: float,
    ) -> None:  # fmt: skip
        super().__init__(runner, staging.rows.shape[0])
        self.geometry, self.staging, self.agent = geometry, staging, agent
        self.registration, self._finish, self.deadline_s = registration, finish, deadline_s

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
            self._give_back(push.held)
            outcome: Outcome = "stuck" if stuck else "failed" if "ERR" in states else "landed"
            self._finish(push.room, push.result, outcome)

    def _prefill_and_post(self, room: Room) -> _Push:
        prompt = room.prompt or []
        with self._holding(cdiv(len(prompt), self.geometry.page_size)) as held:
            token, logprob, top = self._first_token(prompt, held, room.sampling)
            addr = self.staging.write(held.aux_row, aux_row_bytes(room.room, token, logprob, top))
            self._sync()
            src = SourceRoom(len(prompt), held.full_ids, held.swa_ids, addr)
            plans = [(info.agent_name, self._plan(src, info.agent_name, room))
                     for info in room.infos.values() if not info.is_dummy]
            handles = self._post_all(plans)
        num_bytes = sum(s.length for _, plan in plans for _, spans in plan for s in spans)
        result = PrefillResult(room.room, token, logprob, num_bytes, None, top)
        return _Push(room, handles, held, result, time.monotonic() + self.deadline_s)

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
