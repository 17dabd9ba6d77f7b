"""The prefill peer's pipeline: prefill a matched job into the peer's own pools, write the first
token into an aux row, post the NIXL WRITEs of the requested pages and the aux row into the
decode side, and while they fly take the next job.

A job's source pages and aux row stay held until `reap` sees its WRITEs DONE, failed, or past
the request's deadline; then `finish` answers it. Compute thread only (`PrefillPeer` runs it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from decode_worker.daemon.prefill.shell import Held, PushShell
from decode_worker.daemon.prefill.state import Decoder, Job, PrefillResult
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.runner import ModelRunner
from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.kv_checksum import check_host_regions, kv_checksum
from decode_worker.io.kv.nixl_agent import NixlAgent, XferHandle
from decode_worker.io.kv.sender import KVSender, SourcePages, plan_writes
from decode_worker.utils.mathx import cdiv

# finish(job, result, done): answer one job; `done` is its TransferDone once its WRITEs landed
Finish = Callable[[Job, PrefillResult, p.TransferDone | None], None]


@dataclass
class _Push:
    """A job whose WRITEs are in flight; its source pages stay held until they are done."""

    job: Job
    handles: list[XferHandle]
    held: Held
    result: PrefillResult
    done: p.TransferDone
    deadline: float


class PushPipeline(PushShell[_Push]):
    """Prefill-and-WRITE of the jobs `PrefillPeer` matched, several in flight at once.

    `regions` are this peer's own "full", "swa" and "aux" layouts (`aux` is the buffer behind
    "aux"); `agent` has them registered. `finish` is called (compute thread) once per posted
    job when it is reaped.
    """

    def __init__(
        self, runner: ModelRunner, aux: AuxBuffer, regions: dict[str, p.RegionLayout],
        agent: NixlAgent, finish: Finish,
    ) -> None:  # fmt: skip
        super().__init__(runner, aux.num_rows)
        self.aux, self.regions = aux, regions
        self.sender = KVSender(agent)
        self._finish = finish

    def post(self, job: Job, dec: Decoder) -> None:
        """Prefill `job` and post its WRITEs to `dec`. Raises DecodeWorkerError (nothing held)
        when it cannot: too few pages, a model error, a WRITE that fails to post."""
        self._pushes.append(self._prefill_and_post(job, dec))

    def reap(self, now: float) -> None:
        """Finish every push whose WRITEs are all DONE, failed, or past the request deadline."""
        for push in list(self._pushes):
            state = self.sender.check(push.handles)
            if state == "PROC" and now < push.deadline:
                continue
            self._pushes.remove(push)
            self.sender.release(push.handles)
            self._give_back(push.held)
            if state == "DONE":
                self._finish(push.job, push.result, push.done)
            else:
                error = "NIXL WRITE failed" if state == "ERR" else "WRITEs past the deadline"
                self._finish(push.job, PrefillResult(push.job.req.room, None, 0.0, 0, error), None)

    def _prefill_and_post(self, job: Job, dec: Decoder) -> _Push:
        req, ps = job.req, self.runner.pools.page_size
        with self._holding(cdiv(req.prompt_len, ps)) as held:
            token, logprob, top = self._first_token(job.prompt, held, job.sampling)
            self.aux.write(held.aux_row, req.room, token, logprob, req.transfer_id, top)
            self._sync()
            src = SourcePages(held.full_ids, held.swa_ids, held.aux_row)
            plan = plan_writes(req, ps, self.regions, dec.regions, src)
            crc = self._checksum(req, src)  # the bytes the WRITEs send (nothing changes them)
            handles = self.sender.post(dec.agent_name, req, plan)
        result = PrefillResult(req.room, token, logprob, plan.num_bytes, None, top,
                               reused_tokens=req.reused_len)
        done = p.TransferDone(req.transfer_id, req.room, plan.num_bytes, plan.num_descriptors,
                              crc)
        deadline = time.monotonic() + req.deadline_s
        return _Push(job, handles, held, result, done, deadline)

    def _checksum(self, req: p.TransferRequest, src: SourcePages) -> int | None:
        """The CRC-32 of the source pages this transfer writes, when it asks (`kv_checksum.py`).
        Raises ConfigError when the pools are not in host memory (the request fails)."""
        if not req.kv_checksum:
            return None
        ps = self.runner.pools.page_size
        n, first_full, first_swa = (cdiv(req.prompt_len, ps), req.reused_len // ps,
                                    req.swa_window_start // ps)  # fmt: skip
        check_host_regions(self.regions)
        return kv_checksum(self.regions, src.full_page_ids[first_full:n],
                           src.swa_page_ids[first_swa:n])  # fmt: skip

