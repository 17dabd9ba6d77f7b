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

import torch

from decode_worker.core.sampling import MAX_TOP_LOGPROBS, SamplingParams, TopLogprobs
from decode_worker.daemon.prefill.state import Decoder, Job, PageFreeList, PrefillResult
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.grammar import GrammarState
from decode_worker.device.runner import ModelRunner
from decode_worker.device.sampler import Sampler, SampleRow
from decode_worker.errors import OutOfPages
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
    src: SourcePages
    result: PrefillResult
    done: p.TransferDone
    deadline: float


class PushPipeline:
    """Prefill-and-WRITE of the jobs `PrefillPeer` matched, several in flight at once.

    `regions` are this peer's own "full", "swa" and "aux" layouts (`aux` is the buffer behind
    "aux"); `agent` has them registered. `finish` is called (compute thread) once per posted
    job when it is reaped.
    """

    def __init__(
        self, runner: ModelRunner, aux: AuxBuffer, regions: dict[str, p.RegionLayout],
        agent: NixlAgent, finish: Finish,
    ) -> None:  # fmt: skip
        self.runner, self.aux, self.regions = runner, aux, regions
        self.sender = KVSender(agent)
        self.sampler = Sampler(runner.device)
        self._finish = finish
        self._free = PageFreeList(runner.pools.num_pages["full"], runner.pools.num_pages["swa"],
                                  runner.has_swa)
        self._aux_rows = list(range(aux.num_rows))
        self._pushes: list[_Push] = []

    def is_busy(self) -> bool:
        """True while some job's WRITEs are in flight."""
        return bool(self._pushes)

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
            self._free.give(push.src.full_page_ids, push.src.swa_page_ids)
            self._aux_rows.append(push.src.aux_row)
            if state == "DONE":
                self._finish(push.job, push.result, push.done)
            else:
                error = "NIXL WRITE failed" if state == "ERR" else "WRITEs past the deadline"
                self._finish(push.job, PrefillResult(push.job.req.room, None, 0.0, 0, error), None)

    def _take_pages(self, n_pages: int) -> tuple[list[int], list[int]]:
        """Pages for a prompt, waiting for in-flight pushes to return theirs if needed.
        Raises OutOfPages when even an idle peer has too few."""
        while True:
            try:
                return self._free.take(n_pages)
            except OutOfPages:
                if not self._pushes:
                    raise
                self.reap(time.monotonic())
                time.sleep(0.0005)

    def _prefill_and_post(self, job: Job, dec: Decoder) -> _Push:
        req, ps = job.req, self.runner.pools.page_size
        full_ids, swa_ids = self._take_pages(cdiv(req.prompt_len, ps))
        row = self._aux_rows.pop()
        try:
            logits = self.runner.prefill(job.prompt, full_ids, swa_ids)  # logits: [V] f32
            token, logprob, top = first_token(self.sampler, logits, job.sampling)
            self.aux.write(row, req.room, token, logprob, req.transfer_id, top)
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            src = SourcePages(full_ids, swa_ids, row)
            plan = plan_writes(req, ps, self.regions, dec.regions, src)
            crc = self._checksum(req, src)  # the bytes the WRITEs send (nothing changes them)
            handles = self.sender.post(dec.agent_name, req, plan)
        except BaseException:
            self._free.give(full_ids, swa_ids)
            self._aux_rows.append(row)
            raise
        result = PrefillResult(req.room, token, logprob, plan.num_bytes, None, top,
                               reused_tokens=req.reused_len)
        done = p.TransferDone(req.transfer_id, req.room, plan.num_bytes, plan.num_descriptors,
                              crc)
        deadline = time.monotonic() + req.deadline_s
        return _Push(job, handles, src, result, done, deadline)

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


def first_token(sampler: Sampler, logits: torch.Tensor, sampling: SamplingParams | None
                ) -> tuple[int, float, TopLogprobs]:
    """The first output token of a prefill (logits: [V] f32; greedy without `sampling`), its
    logprob under the raw distribution and the MAX_TOP_LOGPROBS most likely tokens (the decode
    side keeps what its request asked); a grammar constrains it (structured output). Both push
    pipelines pick it so."""
    sampling = sampling or SamplingParams(temperature=0.0)
    row = SampleRow(sampling, step=0, return_logprob=True, top_logprobs=MAX_TOP_LOGPROBS,
                    grammar=GrammarState.for_sampling(sampling))
    out = sampler.sample(logits[None], [row])  # logits[None]: [1, V]
    return out.token_ids[0], float(out.logprobs[0] or 0.0), out.top_logprobs[0] or []
