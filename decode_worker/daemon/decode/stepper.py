"""The decode step: pages for the batch -> inputs -> run (graph or eager) -> sample -> commit.

Ready requests join the batch with `start` (their prompt enters the tree); `step` gives every
running request one token, retracting some first when pages run short (they go back to the
prealloc queue with their KV cached). Tokens go out as `Tokens`; a request whose last token ends
it leaves through the request table. Compute thread only.

Inputs persist between steps (`RunningBatch`, `device/decode_inputs.py`): a request's page table
and next token live in a device row, written when a page is added, and the sampler writes each
step's tokens straight into the rows, where the next step reads them ("future token ids").

Host work per step is batch-level (`batch.py`): positions, page edges, window slides, lengths
and stop tokens are numpy operations over the batch's arrays; Python runs per row only for the
rows at a page edge (one step in page_size), the rows whose token may end them, and one append
of each row's token. The step's tokens go out as one `StepTokens` event (rows with logprobs as
their own `Tokens`).

Overlapped scheduling (`scheduler.overlap_schedule`): `step` launches step N+1 (pages planned
one position ahead for the requests of the still-running step N, inputs read on the device),
and only then waits for step N's tokens and commits them, so the host's work hides behind the
device's. A request that step N ends (stop token) was also launched in N+1: that token is
dropped. Requests that finish by length are left out of N+1 up front. Logprobs are computed on
the device beside the tokens and copied with them; a batch with a grammar row samples
synchronously (the grammar's mask needs the committed tokens). A request that ends while a
launched step still uses its pages keeps them until that step is waited for
(the request table parks it: STEPS).
```
engine.step k:  [admit, start]  plan N+1 -> launch N+1 -> wait N -> commit N  [publish]
device:         ...... step N ...... | ........ step N+1 ........
```
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from decode_worker.core.admission import PreallocQueue
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.request import RequestState
from decode_worker.daemon.decode.batch import Order, RunningBatch, SampleKind
from decode_worker.daemon.decode.bridge import StepTokens
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.daemon.decode.speculate import Speculator
from decode_worker.daemon.decode.verify import Verifier
from decode_worker.device.decode_inputs import HostTokens
from decode_worker.device.runner import DecodeRunner
from decode_worker.device.sampler import (
    SampleOutput,
    Sampler,
    SampleRow,
    device_logprobs,
    logprob_lists,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    """A launched step: its rows (and their gen then), and their tokens (on their way, or
    sampled on the host)."""

    order: Order
    gen: np.ndarray  # [n] the rows' `RunningBatch.gen` at launch
    version: int  # `RunningBatch.version` at launch (unchanged: every row is still there)
    tokens: HostTokens | None
    sampled: SampleOutput | None


class DecodeStepper:
    """Runs the table's running batch on the model, one token per request per step."""

    def __init__(self, table: RequestTable, queue: PreallocQueue, decode_alloc: DecodeAllocator,
                 runner: DecodeRunner, sampler: Sampler, *, overlap: bool = True,
                 spec: Speculator | None = None) -> None:
        """`spec`: speculative decoding's policy and drafter (`verify.py` runs its steps)."""
        self.table, self.queue, self.decode_alloc = table, queue, decode_alloc
        self.runner, self.sampler, self.overlap = runner, sampler, overlap
        self.batch: RunningBatch = table.running
        self.in_flight: _Launched | None = None
        self.generated_tokens_total = 0
        self.spec = spec
        self.verifier = (Verifier(self.batch, decode_alloc, runner, sampler, table, spec)
                         if spec is not None else None)

    @property
    def busy(self) -> bool:
        """A launched step is not committed yet (call `step` again, even without a batch)."""
        return self.in_flight is not None

    def start(self, live: LiveRequest, now: float) -> None:
        """READY -> RUNNING: insert the received prompt into the tree (dedup and repoint onto
        cache-owned pages), join the batch, send the first token, and end at once if it already
        ends."""
        live.req.transition(RequestState.RUNNING, now, keeper=self.decode_alloc.ctx)
        self.batch.join(live)
        if self.spec is not None:
            self.spec.joined(live.rid, live.req.prompt_ids, live.req.output_ids)
        self._commit(live, now)

    def step(self, now: float, ready: Iterable[LiveRequest] = ()) -> None:
        """`ready` requests join the batch (`start`), then one token for every running request
        (retracting some first if pages are short). With overlap on, the tokens committed are
        those of the step launched last time. Without a batch or a launched step: nothing."""
        for live in ready:
            self.start(live, now)
        spec = self.spec
        if spec is None:
            self._plain_step(now)
            return
        # the policy learns what steps cost here (drafting, commits and lost overlap included)
        t0, rows = time.perf_counter(), len(self.batch)
        # a grammar row samples on the host and never drafts: no drafting attempt then
        if (rows and self.batch.kind_of_batch() is not SampleKind.HOST and spec.may_draft()
                and self._speculate(now)):
            assert self.verifier is not None
            spec.observe_step(self.verifier.last_entries, time.perf_counter() - t0, verify=True)
            return
        self._plain_step(now)
        if rows:
            spec.observe_step(rows, time.perf_counter() - t0, verify=False)

    def _plain_step(self, now: float) -> None:
        prev, self.in_flight = self.in_flight, None
        launched = self._launch(now) if self.batch else None
        if self.spec is not None:
            self.spec.flush()  # the drafter's indexing, while the device computes
        if prev is not None:
            self._commit_step(prev, now)
        if launched is not None and (launched.sampled is not None or not self.overlap):
            self._commit_step(launched, now)
        else:
            self.in_flight = launched

    def _speculate(self, now: float) -> bool:
        """A verify step (`verify.py`) if the policy drafts; False: run a plain step. Drafts
        need every committed token, so a launched step is committed first (no overlap)."""
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            self._commit_step(prev, now)
        assert self.verifier is not None
        committed = self.verifier.try_step(now)
        if committed is None:
            return False
        self.generated_tokens_total += committed
        return True

    def _launch(self, now: float) -> _Launched | None:
        """Plan pages, write the inputs that changed, run the model and sample on the device."""
        planned = self._plan_pages(now)
        if planned is None:
            return None
        order, positions, ahead = planned  # [n] each; `ahead` before this launch
        batch, rows = self.batch, order.rows
        kind = batch.kind_of_batch()
        inputs = batch.inputs
        logits, rows_t = self.runner.decode_rows(inputs, rows, positions)  # [n, V]
        batch.pos[rows] = positions + 1
        batch.ahead[rows] = ahead + 1
        gen = batch.gen[rows]
        if kind is SampleKind.GREEDY:  # no per-request rows to build
            chosen = logits.argmax(dim=-1)  # [n] i64 on the device
        elif kind is SampleKind.DEVICE:  # parameters from the batch's arrays, not per row
            params = batch.sample_params(rows, ahead, logits.shape[1], logits.device)
            chosen = self.sampler.choose_batch(logits, params)  # [n] i64 on the device
        else:
            sample_rows = [_row(lv, a) for lv, a in zip(order.lives, ahead.tolist(), strict=True)]
            out = self.sampler.sample(logits, sample_rows)  # waits for the step
            for row, token in zip(rows.tolist(), out.token_ids, strict=True):
                inputs.write_token(row, token)
            return _Launched(order, gen, batch.version, None, out)
        inputs.tokens[rows_t] = chosen  # the next step's inputs, written on the device
        extras: tuple[torch.Tensor, ...] = ()
        if batch.logprob_members:
            lp_rows, max_top = batch.logprobs_wanted(rows)
            if lp_rows.any():
                extras = device_logprobs(logits, chosen, max_top)
        return _Launched(order, gen, batch.version, self.runner.fetch_tokens(chosen, extras),
                         None)

    def _plan_pages(self, now: float) -> tuple[Order, np.ndarray, np.ndarray] | None:
        """The rows to launch, each holding the pages (and row entries) its position needs:
        rows its uncommitted step ends by length are left out; rows at a page edge or a window
        slide get their pages from the core; when the pools stay short the whole batch goes
        through `prepare_step`, which retracts (see `_retract`). Returns the rows with their
        positions and uncommitted steps ([n] each)."""
        batch = self.batch
        order = batch.order()
        rows = order.rows
        ahead = batch.ahead[rows]
        go = batch.left[rows] > ahead  # [n] not ended by the uncommitted step's length
        if not go.all():
            order = order.subset(go)
            rows, ahead = order.rows, ahead[go]
        pos = batch.pos[rows]
        grow = np.flatnonzero(pos >= batch.edge[rows])
        slide = np.flatnonzero(pos - ahead >= batch.slide_at[rows])
        if not grow.size and not slide.size:
            return (order, pos, ahead) if order.lives else None
        lives = order.lives
        if slide.size:  # the window moved: SWA pages leave it
            sliding = [lives[i] for i in slide.tolist()]
            self.decode_alloc.slide([lv.req for lv in sliding])
            for live in sliding:
                batch.slid(live)
        if grow.size:  # a page edge: a new full page, an SWA page to get or write
            growing = [lives[i] for i in grow.tolist()]
            far = {lv.rid: a for lv, a in zip(growing, ahead[grow].tolist(), strict=True) if a}
            if not self.decode_alloc.grow([lv.req for lv in growing], far):
                kept = self._retract(order, ahead, now)
                if kept is None:
                    return None
                return kept, batch.pos[kept.rows], batch.ahead[kept.rows]
            for live in growing:
                batch.refresh(live)
        return order, pos, ahead

    def _retract(self, order: Order, ahead: np.ndarray, now: float) -> Order | None:
        """The pools are short after evicting: `prepare_step` over the launchable rows retracts
        some (back to the prealloc queue, their computed KV cached) and gives the rest their
        pages."""
        batch = self.batch
        far = {lv.rid: a for lv, a in zip(order.lives, ahead.tolist(), strict=True) if a}
        plan = self.decode_alloc.prepare_step([lv.req for lv in order.lives], now, far)
        gone = {id(r) for r in plan.retracted}
        for live in order.lives:
            if id(live.req) in gone:
                batch.leave(live)
                log.info("rid=%s retracted after %d tokens", live.rid, len(live.req.output_ids))
            else:
                batch.refresh(live)
                batch.slid(live)
        if plan.retracted:
            self.queue.requeue(plan.retracted, now)
        return order.subset(np.array([id(lv.req) not in gone for lv in order.lives], bool)
                            ) if plan.runnable else None

    def _commit_step(self, step: _Launched, now: float) -> None:
        """Append each request's token and send it; skip rows whose request left meanwhile."""
        batch, order, out = self.batch, step.order, step.sampled
        tokens = (np.asarray(out.token_ids, np.int64) if out is not None
                  else step.tokens.wait_array())  # type: ignore[union-attr]  # [n]
        batch.steps_done += 1  # the step is over: pages only it used may go (table.poll)
        kept = None
        if step.version != batch.version:  # some left: ended (a stop token, an abort), retracted
            same = batch.gen[order.rows] == step.gen  # [n] the row's request is still there
            kept = np.flatnonzero(same)
            order, tokens = order.subset(same), tokens[same]
        rows = order.rows
        batch.ahead[rows] -= 1
        batch.left[rows] -= 1
        if out is not None:
            self._commit_host(order, tokens, out, kept, now)
            return
        toks = tokens.tolist()
        order.commit.commit(toks)
        self.generated_tokens_total += len(toks)
        extras = step.tokens.extras()  # type: ignore[union-attr]
        if extras:  # rows with logprobs go out one by one, with them
            self._send_with_logprobs(order, extras, kept)
        else:
            self.table.outbox.put(StepTokens(order.rids, toks))
        ends = np.flatnonzero((batch.left[rows] <= 0) | batch.stop_hits(tokens))
        for i in ends.tolist():
            self._finish_if_done(order.lives[i], now)

    def _send_with_logprobs(self, order: Order, extras: tuple[torch.Tensor, ...],
                            kept: np.ndarray | None) -> None:
        """The step computed logprobs on the device (some row wants them): those rows' tokens
        go out with theirs as `Tokens`, the others' in one `StepTokens`."""
        if kept is not None:  # the launched rows still there
            index = torch.from_numpy(kept)
            extras = tuple(t[index] for t in extras)
        want, top = self.batch.want_lp[order.rows], self.batch.top_n[order.rows]  # [n] each
        wants = want | (top > 0)
        lps, tops = logprob_lists(extras, want.tolist(), top.tolist())
        plain = ~wants
        if plain.any():
            rest = order.subset(plain)
            self.table.outbox.put(StepTokens(rest.rids, rest.commit.last_tokens()))
        for i in np.flatnonzero(wants).tolist():
            live = order.lives[i]
            live.record_logprobs(lps[i], tops[i])
            event = live.new_tokens()  # (such a row always goes out this way: `emitted` holds)
            if event is not None:
                self.table.outbox.put(event)

    def _commit_host(self, order: Order, tokens: np.ndarray, out: SampleOutput,
                     kept: np.ndarray | None, now: float) -> None:
        """A host-sampled step (a grammar row): each row's token, logprobs and end."""
        index = range(len(out.token_ids)) if kept is None else kept.tolist()
        order.commit.commit(tokens.tolist())
        for live, i in zip(order.lives, index, strict=True):
            live.emitted = len(live.req.output_ids) - 1  # stale while fast steps sent tokens
            live.record_logprobs(out.logprobs[i], out.top_logprobs[i])
            self._commit(live, now)

    def _commit(self, live: LiveRequest, now: float) -> None:
        """Send new tokens; on a stop token / EOS / max_new_tokens end the request (its KV is
        cached in the tree)."""
        event = live.new_tokens()
        if event is not None:
            self.generated_tokens_total += len(event.chunk.token_ids)
            self.table.outbox.put(event)
        self._finish_if_done(live, now)

    def _finish_if_done(self, live: LiveRequest, now: float) -> None:
        finish = live.finish_reason()
        if finish is not None:
            reason, matched = finish
            self.table.end(live, reason, "", now, matched_stop=matched)


def _row(live: LiveRequest, ahead: int) -> SampleRow:
    """The request's sample row; one token further when its previous step is uncommitted
    (a seeded row's noise is keyed by the token's index, whatever the overlap)."""
    row = live.sample_row()
    return replace(row, step=row.step + ahead) if ahead else row


def sample_kind(live: LiveRequest) -> SampleKind:
    """How the request's tokens are chosen (fixed for its life): HOST for a grammar (its mask
    needs the committed tokens; the step samples synchronously). Logprobs are computed on the
    device beside the tokens and copied with them."""
    if live.has_grammar:
        return SampleKind.HOST
    return SampleKind.GREEDY if live.cmd.sampling.is_greedy else SampleKind.DEVICE
