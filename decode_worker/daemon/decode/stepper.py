"""The decode step: pages for the batch -> inputs -> run (graph or eager) -> sample -> commit.

Ready requests join the batch with `start` (their prompt enters the tree); `step` gives every
running request one token, retracting some first when pages run short (they go back to the
prealloc queue with their KV cached). Tokens go out as `Tokens`; a request whose last token ends
it leaves through the request table. Compute thread only.
"""

from __future__ import annotations

import logging

from decode_worker.core.admission import PreallocQueue
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.request import RequestState
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.device.runner import DecodeBatch, ModelRunner
from decode_worker.device.sampler import Sampler

log = logging.getLogger(__name__)


class DecodeStepper:
    """Runs the table's running batch on the model, one token per request per step."""

    def __init__(self, table: RequestTable, queue: PreallocQueue, decode_alloc: DecodeAllocator,
                 runner: ModelRunner, sampler: Sampler) -> None:
        self.table, self.queue, self.decode_alloc = table, queue, decode_alloc
        self.runner, self.sampler = runner, sampler
        self.generated_tokens_total = 0

    def start(self, live: LiveRequest, now: float) -> None:
        """READY -> RUNNING: insert the received prompt into the tree (dedup and repoint onto
        cache-owned pages), send the first token, and end at once if it already ends."""
        self.decode_alloc.start_running(live.req, now)
        self.table.running.append(live)
        self._commit(live, now)

    def step(self, now: float) -> None:
        """One token for every running request (retracting some first if pages are short)."""
        batch_lives = self._plan_pages(now)
        if not batch_lives:
            return
        logits = self.runner.decode(_build_batch(batch_lives))  # [bs, V] f32
        out = self.sampler.sample(logits, [lv.sample_row() for lv in batch_lives])
        for live, token, lp, top in zip(batch_lives, out.token_ids, out.logprobs,
                                        out.top_logprobs, strict=True):
            live.req.append_token(token)
            live.record_logprobs(lp, top)
            self._commit(live, now)

    def _plan_pages(self, now: float) -> list[LiveRequest]:
        """Give every running request the pages its next token needs (sliding SWA pages out of
        the window); retracted requests go back to the prealloc queue, their computed KV
        cached. Returns the requests that run this step."""
        running = self.table.running
        by_rid = {lv.rid: lv for lv in running}
        plan = self.decode_alloc.prepare_step([lv.req for lv in running], now)
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


def _build_batch(lives: list[LiveRequest]) -> DecodeBatch:
    """Each request feeds its last output token at position `kv.seq_len` (the KV of every
    earlier token is in its pages)."""
    tokens, positions, full, swa = [], [], [], []
    for live in lives:
        kv = live.req.kv
        assert kv is not None and live.req.state is RequestState.RUNNING  # RUNNING holds kv
        tokens.append(live.req.output_ids[-1])
        positions.append(kv.seq_len)
        full.append(kv.full_page_ids)
        # a model without SWA layers holds no SWA pages: its (never read) table is all dummy
        swa.append(kv.swa_page_ids or [0] * len(kv.full_page_ids))
    return DecodeBatch(tokens, positions, full, swa)
