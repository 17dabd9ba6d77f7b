"""A verify step: every running request's input token and its drafts in one forward, then each
request commits its kept drafts and one more token (1 .. k + 1 tokens).

```
drafts (Speculator) -> pages up to pos + k (core) -> one forward over sum(1 + k) entries
  -> kept drafts + bonus (device/spec_accept.py) -> cut at a stop token and at the length
  -> StepCommit.commit_runs -> each request's tokens out, its end if it ends
```
A request is `1 + k` consecutive entries of `ModelRunner.decode_rows` at positions
`pos .. pos + k`: each entry is one query, all K/V is written before any is read. A refused
draft's K/V sits past the committed length, where no query reads it before the position is
written again; the SWA ring keeps `window + K` positions, so a draft's write never lands on a
page some query of the step still reads. The step runs synchronously (drafts need the
committed tokens): the stepper commits any launched step first. Compute thread only.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.daemon.decode.batch import Order, RunningBatch
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.daemon.decode.speculate import Speculator, TokenView
from decode_worker.device.runner import DecodeRunner
from decode_worker.device.sampler import Sampler, device_logprobs, logprob_lists
from decode_worker.device.spec_accept import Drafts, accept


class Verifier:
    """Verify steps over the batch the stepper runs (it owns the batch; this borrows it)."""

    def __init__(self, batch: RunningBatch, decode_alloc: DecodeAllocator, runner: DecodeRunner,
                 sampler: Sampler, table: RequestTable, spec: Speculator) -> None:
        self.batch, self.decode_alloc, self.runner = batch, decode_alloc, runner
        self.sampler, self.table, self.spec = sampler, table, spec
        self.verify_seconds: list[float] = []  # drained by the books into the histogram
        self.last_entries = 0  # the entries of the latest verify step's forward

    def try_step(self, now: float) -> int | None:
        """Run one verify step when the policy drafts; the tokens it committed, or None (no
        drafts this step, or their pages are short: the stepper runs a plain step). The
        stepper calls it for a batch with rows and without a grammar row (those never draft)."""
        batch = self.batch
        order = batch.order()
        rows = order.rows
        caps = (batch.left[rows] - 1).tolist()  # a run never passes max_new_tokens
        views = [TokenView(lv.req.prompt_ids, lv.req.output_ids) for lv in order.lives]
        drafts = self.spec.drafts(order.rids, views, caps)
        if drafts is None:
            return None
        ks = np.fromiter((len(d) for d in drafts), np.int64, len(drafts))  # [n]
        if not self._plan_pages(order, ks):
            return None
        t0 = time.perf_counter()
        self.last_entries = int(ks.sum()) + len(ks)
        runs = self._run(order, drafts, ks)
        committed = self._commit(order, drafts, runs, now)
        self.verify_seconds.append(time.perf_counter() - t0)
        return committed

    def _plan_pages(self, order: Order, ks: np.ndarray) -> bool:
        """Slide the windows that moved, then hold each request's pages up to `pos + k` (False,
        nothing given, when the pools stay short even after evicting)."""
        batch, rows, lives = self.batch, order.rows, order.lives
        pos = batch.pos[rows]  # [n]; nothing is in flight: pos = kv.seq_len
        slide = np.flatnonzero(pos >= batch.slide_at[rows])
        if slide.size:
            sliding = [lives[i] for i in slide.tolist()]
            self.decode_alloc.slide([lv.req for lv in sliding])
            for live in sliding:
                batch.slid(live)
        grow = np.flatnonzero(pos + ks >= batch.edge[rows])
        if not grow.size:
            return True
        growing = [lives[i] for i in grow.tolist()]
        far = {lv.rid: int(k) for lv, k in zip(growing, ks[grow].tolist(), strict=True)}
        if not self.decode_alloc.grow([lv.req for lv in growing], far):
            return False
        for live, reach in zip(growing, (pos + ks)[grow].tolist(), strict=True):
            batch.refresh(live, reach)
        return True

    def _run(self, order: Order, drafts: list[list[int]], ks: np.ndarray) -> list[list[int]]:
        """The forward over every entry and each request's run (kept drafts + the bonus)."""
        batch, rows = self.batch, order.rows
        plan = Drafts.of(drafts)
        counts = ks + 1  # [n] entries per request
        rep = np.repeat(rows, counts)  # [T] each entry's row
        within = np.arange(len(rep)) - np.repeat(plan.starts, counts)  # [T] 0 .. k
        positions = np.repeat(batch.pos[rows], counts) + within  # [T]
        logits, _ = self.runner.decode_rows(batch.inputs, rep, positions,
                                            (plan.input_entries(), plan.tokens))  # [T, V]
        self.spec.flush()  # the drafter's deferred indexing, while the forward runs
        params, keys = batch.entry_params(rows, counts, logits.shape[1], logits.device)
        runs = accept(logits, params, plan, self.sampler.generator, keys)
        self._logprobs(order, plan, logits, runs)
        return runs

    def _logprobs(self, order: Order, plan: Drafts, logits: torch.Tensor,
                  runs: list[list[int]]) -> None:
        """Each committed token's logprob (and alternatives) from the entry that chose it, for
        the requests that asked: exactly what a plain step computes for that position."""
        if not self.batch.logprob_members:
            return
        want, top = (self.batch.want_lp[order.rows], self.batch.top_n[order.rows])  # [n] each
        asked = np.flatnonzero(want | (top > 0))
        if not asked.size:
            return
        entries = [int(plan.starts[i]) + j for i in asked.tolist() for j in range(len(runs[i]))]
        tokens = [t for i in asked.tolist() for t in runs[i]]
        dev = logits.device
        host = [t.cpu() for t in device_logprobs(
            logits[torch.tensor(entries, device=dev)], torch.tensor(tokens, device=dev),
            int(top[asked].max()))]
        per = [len(runs[i]) for i in asked.tolist()]
        lps, tops = logprob_lists(host, np.repeat(want[asked], per).tolist(),
                                  np.repeat(top[asked], per).tolist())
        o = 0
        for i, n in zip(asked.tolist(), per, strict=True):
            live = order.lives[i]
            for j in range(n):
                live.record_logprobs(lps[o + j], tops[o + j])
            o += n

    def _commit(self, order: Order, drafts: list[list[int]], runs: list[list[int]],
                now: float) -> int:
        """Commit the runs (cut at the first stop token: what follows it never happened), send
        each request's new tokens, end those that ended."""
        batch, rows, lives = self.batch, order.rows, order.lives
        runs = [_cut_at_stop(run, lv) for run, lv in zip(runs, lives, strict=True)]
        order.commit.commit_runs(runs)
        lens = np.fromiter((len(r) for r in runs), np.int64, len(runs))  # [n]
        batch.pos[rows] += lens
        batch.left[rows] -= lens
        batch.steps_done += 1
        inputs, outbox = batch.inputs, self.table.outbox
        for row, run in zip(rows.tolist(), runs, strict=True):
            inputs.write_token(row, run[-1])  # the next step's input
        self.spec.record(order.rids, drafts, runs)
        for live, run, draft in zip(lives, runs, drafts, strict=True):
            live.emitted = len(live.req.output_ids) - len(run)
            live.count_verify(len(draft), len(run) - 1)
            event = live.new_tokens()
            if event is not None:
                outbox.put(event)
        for live in lives:
            finish = live.finish_reason()
            if finish is not None:
                self.table.end(live, finish[0], "", now, matched_stop=finish[1])
        return int(lens.sum())


def _cut_at_stop(run: list[int], live: LiveRequest) -> list[int]:
    """`run` up to and with its first stop token (the request ends there)."""
    stops = live.stop_ids
    for i, t in enumerate(run):
        if t in stops:
            return run[:i + 1]
    return run
