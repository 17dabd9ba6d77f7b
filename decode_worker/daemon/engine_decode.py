"""The decode step: schedule -> prepare inputs -> run (graph or eager) -> sample -> commit.

A mixin of `DecodeEngine` (compute thread only); it reads the engine's running batch, runner,
sampler and allocators, and emits token events.
"""

from __future__ import annotations

import logging

from decode_worker.core.request import RequestState
from decode_worker.daemon.engine_state import EngineState
from decode_worker.daemon.live import LiveRequest
from decode_worker.device.runner import DecodeBatch

log = logging.getLogger(__name__)


class DecodeOps(EngineState):
    """Running-batch operations of the engine."""

    def start_ready(self, live: LiveRequest, now: float) -> None:
        """READY -> RUNNING: insert the received prompt into the tree (dedup and repoint onto
        cache-owned pages), send the first token, and finish at once if it already ends."""
        self.decode_alloc.start_running(live.req, now)
        self.running.append(live)
        self._emit_progress(live, now)

    def decode_step(self, now: float) -> None:
        """One token for every running request (retracting some first if pages are short)."""
        batch_lives = self.plan_decode_pages(now)
        if not batch_lives:
            return
        batch = _build_batch(batch_lives)
        logits = self.rt.runner.decode(batch)  # [bs, V] f32
        out = self.sampler.sample(logits, [lv.sample_row() for lv in batch_lives])
        for live, token, lp, top in zip(batch_lives, out.token_ids, out.logprobs,
                                        out.top_logprobs, strict=True):
            live.req.append_token(token)
            live.record_logprobs(lp, top)
            self._emit_progress(live, now)

    def _emit_progress(self, live: LiveRequest, now: float) -> None:
        """Send new tokens; on a stop token / EOS / max_new_tokens end the request (its KV is
        cached in the tree)."""
        finish = live.finish_reason()
        if finish is None and live.emitted == len(live.req.output_ids):
            return  # a resumed request: nothing new to say yet
        event = live.new_tokens_event(finish)
        self.metrics.inc_generated_tokens(len(event.chunk.token_ids))
        self.outbox.put(event)
        if finish is not None:
            self.end(live, RequestState.FINISHED, now)


def _build_batch(lives: list[LiveRequest]) -> DecodeBatch:
    """Each request feeds its last output token at position `kv.seq_len` (the KV of every
    earlier token is in its pages)."""
    tokens, positions, full, swa = [], [], [], []
    for live in lives:
        kv = live.req.kv
        assert kv is not None  # RUNNING holds kv (state machine invariant)
        tokens.append(live.req.output_ids[-1])
        positions.append(kv.seq_len)
        full.append(kv.full_page_ids)
        # a model without SWA layers holds no SWA pages: its (never read) table is all dummy
        swa.append(kv.swa_page_ids or [0] * len(kv.full_page_ids))
    return DecodeBatch(tokens, positions, full, swa)
