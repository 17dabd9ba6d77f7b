"""The decode step: pages for the batch -> inputs -> run (graph or eager) -> sample -> commit.

Ready requests join the batch with `start` (their prompt enters the tree); `step` gives every
running request one token, retracting some first when pages run short (they go back to the
prealloc queue with their KV cached). Tokens go out as `Tokens`; a request whose last token ends
it leaves through the request table. Compute thread only.

Inputs persist between steps (`StepRows`, `device/decode_slots.py`): a request's page table and
next token live in a device row, written when a page is added, and the sampler writes each
step's tokens straight into the rows, where the next step reads them ("future token ids").

Overlapped scheduling (`scheduler.overlap_schedule`): `step` launches step N+1 (pages planned
one position ahead for the requests of the still-running step N, inputs read on the device),
and only then waits for step N's tokens and commits them, so the host's work hides behind the
device's. A request that step N ends (stop token) was also launched in N+1: that token is
dropped. Requests that finish by length are left out of N+1 up front. A batch with a row that
needs the host (logprobs, a grammar) samples synchronously.
```
engine.step k:  [admit, start]  plan N+1 -> launch N+1 -> wait N -> commit N  [publish]
device:         ...... step N ...... | ........ step N+1 ........
```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from decode_worker.core.admission import PreallocQueue
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.request import RequestState
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.daemon.decode.step_rows import SampleKind, StepRows
from decode_worker.device.decode_slots import HostTokens
from decode_worker.device.runner import DecodeRunner
from decode_worker.device.sampler import SampleOutput, Sampler, SampleRow

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    """A launched step: its requests and their tokens (on their way, or sampled on the host)."""

    lives: list[LiveRequest]
    tokens: HostTokens | None
    sampled: SampleOutput | None


class DecodeStepper:
    """Runs the table's running batch on the model, one token per request per step."""

    def __init__(self, table: RequestTable, queue: PreallocQueue, decode_alloc: DecodeAllocator,
                 runner: DecodeRunner, sampler: Sampler, *, max_running: int,
                 overlap: bool = True) -> None:
        self.table, self.queue, self.decode_alloc = table, queue, decode_alloc
        self.runner, self.sampler, self.overlap = runner, sampler, overlap
        self.rows = StepRows(runner.new_slots(max_running), sample_kind)
        self.in_flight: _Launched | None = None
        self.generated_tokens_total = 0

    @property
    def busy(self) -> bool:
        """A launched step is not committed yet (call `step` again, even without a batch)."""
        return self.in_flight is not None

    def start(self, live: LiveRequest, now: float) -> None:
        """READY -> RUNNING: insert the received prompt into the tree (dedup and repoint onto
        cache-owned pages), send the first token, and end at once if it already ends."""
        self.decode_alloc.start_running(live.req, now)
        self.table.running.append(live)
        self._commit(live, now)

    def step(self, now: float) -> None:
        """One token for every running request (retracting some first if pages are short).
        With overlap on, the tokens committed are those of the step launched last time."""
        prev, self.in_flight = self.in_flight, None
        launched = self._launch(prev, now) if self.table.running else None
        if prev is not None:
            self._commit_step(prev, now)
        if launched is not None and (launched.sampled is not None or not self.overlap):
            self._commit_step(launched, now)
        else:
            self.in_flight = launched

    def _launch(self, prev: _Launched | None, now: float) -> _Launched | None:
        """Plan pages, write the inputs that changed, run the model and sample on the device."""
        # still-running requests of the uncommitted step (a rid may return in a new request)
        ahead = ({lv.req.rid for lv in prev.lives if lv.req.state is RequestState.RUNNING}
                 if prev is not None else set())
        lives = self._plan_pages(now, ahead)
        if not lives:
            return None
        positions = [lv.req.kv.seq_len + (lv.req.rid in ahead)  # type: ignore[union-attr]
                     for lv in lives]  # RUNNING requests hold kv
        slot_ids, kind = self.rows.sync(lives, positions)
        slots = self.rows.slots
        logits, slots_t = self.runner.decode_slots(slots, slot_ids, positions)  # [bs, V]
        if kind is SampleKind.GREEDY:  # no per-request rows to build
            chosen = logits.argmax(dim=-1)  # [bs] i64 on the device
        else:
            rows = [_row(lv, lv.req.rid in ahead) for lv in lives]
            if kind is SampleKind.HOST:
                out = self.sampler.sample(logits, rows)  # waits for the step
                for slot, token in zip(slot_ids, out.token_ids, strict=True):
                    slots.write_token(slot, token)
                return _Launched(lives, None, out)
            chosen = self.sampler.choose(logits, rows)  # [bs] i64 on the device
        slots.tokens[slots_t] = chosen  # the next step's inputs, written on the device
        return _Launched(lives, self.runner.fetch_tokens(chosen), None)

    def _commit_step(self, step: _Launched, now: float) -> None:
        """Append each request's token and send it; skip requests that left meanwhile."""
        out = step.sampled
        tokens = out.token_ids if out is not None else step.tokens.wait()  # type: ignore[union-attr]
        running = RequestState.RUNNING
        for i, (live, token) in enumerate(zip(step.lives, tokens, strict=True)):
            if live.req.state is not running:
                continue  # ended (a stop token in the step before, an abort) or retracted
            live.req.append_token(token)
            if out is not None:  # (device-sampled rows asked for no logprobs)
                live.record_logprobs(out.logprobs[i], out.top_logprobs[i])
            self._commit(live, now)

    def _plan_pages(self, now: float, ahead: set[str]) -> list[LiveRequest]:
        """Give every running request the pages its next token needs (sliding SWA pages out of
        the window); retracted requests go back to the prealloc queue, their computed KV
        cached. `ahead`: requests whose launched step is not committed (their next position is
        one further; those it will end by length are left out). Returns the batch."""
        running = self.table.running
        cands = [lv for lv in running if lv.req.rid not in ahead
                 or len(lv.req.output_ids) + 1 < lv.req.max_new_tokens]
        by_rid = {lv.req.rid: lv for lv in cands}
        plan = self.decode_alloc.prepare_step([lv.req for lv in cands], now, ahead)
        if plan.retracted:
            self.queue.requeue(plan.retracted, now)
            gone = {r.rid for r in plan.retracted}
            running[:] = [lv for lv in running if lv.rid not in gone]
            for req in plan.retracted:
                log.info("rid=%s retracted after %d tokens", req.rid, len(req.output_ids))
        return [by_rid[r.rid] for r in plan.runnable]

    def _commit(self, live: LiveRequest, now: float) -> None:
        """Send new tokens; on a stop token / EOS / max_new_tokens end the request (its KV is
        cached in the tree)."""
        event = live.new_tokens()
        if event is not None:
            self.generated_tokens_total += len(event.chunk.token_ids)
            self.table.outbox.put(event)
        finish = live.finish_reason()
        if finish is not None:
            reason, matched = finish
            self.table.end(live, reason, "", now, matched_stop=matched)


def _row(live: LiveRequest, ahead: bool) -> SampleRow:
    """The request's sample row; one token further when its previous step is uncommitted
    (a seeded row's noise is keyed by the token's index, whatever the overlap)."""
    row = live.sample_row()
    return replace(row, step=row.step + 1) if ahead else row


def sample_kind(live: LiveRequest) -> SampleKind:
    """How the request's tokens are chosen (fixed for its life): HOST for logprobs or a
    grammar (its mask needs the committed tokens; the step samples synchronously)."""
    cmd = live.cmd
    if cmd.return_logprob or cmd.top_logprobs or live.has_grammar:
        return SampleKind.HOST
    return SampleKind.GREEDY if cmd.sampling.is_greedy else SampleKind.DEVICE
