"""A request's way through the engine outside its transfer and its decode steps: arrival
(checked, queued), admission (the prealloc queue's decisions become transfers or answers),
cancellation, drain, and the one terminal path (`end`) every other part ends a request through.

A mixin of `DecodeEngine` (compute thread only).
"""

from __future__ import annotations

import logging

from decode_worker.core.admission import Abort, Admit
from decode_worker.core.request import TERMINAL, DecodeRequest, RequestState
from decode_worker.daemon.bridge import AddRequest
from decode_worker.daemon.engine_state import EngineState
from decode_worker.daemon.live import LiveRequest, abort_status
from decode_worker.errors import DecodeWorkerError

log = logging.getLogger(__name__)
S = RequestState


class RequestOps(EngineState):
    """Request lifecycle operations of the engine."""

    def add(self, cmd: AddRequest, now: float) -> None:
        vocab = self.rt.runner.model.cfg.vocab_size
        bad = [t for t in cmd.input_ids if not 0 <= t < vocab]
        if bad or not cmd.input_ids:
            # the API checks this too; the engine never trusts its caller with the device
            live = LiveRequest(DecodeRequest(cmd.rid, 0, list(cmd.input_ids), 0), cmd, frozenset())
            why = f"token ids outside [0, {vocab}): {bad[:5]}" if bad else "empty prompt"
            self.metrics.inc_abort("bad_request")
            self.outbox.put(live.error_event(why, 400, "bad_request"))
            return
        req = DecodeRequest(cmd.rid, cmd.bootstrap_room or 0, list(cmd.input_ids),
                            cmd.sampling.max_new_tokens)
        live = LiveRequest(req, cmd, frozenset(self.rt.tokenizer.eos_token_ids))
        self.lives[cmd.rid] = live
        try:
            ab = self.queue.add(req, now)
        except Exception as exc:  # ServiceUnavailable: queue full
            self.lives.pop(cmd.rid, None)
            self.outbox.put(live.error_event(str(exc), 503, "queue_full"))
            return
        if ab is not None:
            self._on_queue_abort(ab)

    def cancel(self, live: LiveRequest, reason: str, now: float) -> None:
        """Client abort, stop string or drain: end the request wherever it is."""
        req = live.req
        if req.state in (S.RESERVED, S.RECEIVING) and live.transfer_id is not None:
            req.reason = reason  # pages come back on "released"
            self.abort_transfer(live)
            if not live.answered:
                self.outbox.put(live.error_event(f"aborted: {reason}", 499, reason))
            return
        to = S.FINISHED if reason == "stop" and req.state is S.RUNNING else S.ABORTED
        self.end(live, to, now, reason=reason)

    def admit(self, now: float) -> None:
        for d in self.queue.pop_admitted(now):
            if isinstance(d, Abort):
                self._on_queue_abort(d)
            elif isinstance(d, Admit):
                self.metrics.inc_admission()
                self.metrics.observe_prefix_match(d.req.fill_len, d.prefix_len)
                live = self.lives[d.req.rid]
                try:
                    self.fetch_kv(live, d, now)
                except DecodeWorkerError as exc:  # this request's inputs, not the engine
                    log.warning("rid=%s failed to start: %s", live.rid, exc)
                    self.fail(live, "bad_request", str(exc), now)

    def end(self, live: LiveRequest, to: RequestState, now: float, *, reason: str = "") -> None:
        """Terminal transition: pages and locks are released (valid KV stays cached)."""
        req = live.req
        if req.state is S.QUEUED:  # the queue owns QUEUED requests
            self.queue.abort(req.rid, now, reason or "internal")
        elif req.state not in TERMINAL:
            req.transition(to, now, releaser=self.kv_ctx, reason=reason)
        self.lives.pop(req.rid, None)
        if to is S.FINISHED:
            self.metrics.inc_request("finished")
        elif to is S.FAILED:
            self.metrics.inc_request("failed")
        else:
            self.metrics.inc_abort(reason or "internal")
        if not live.answered:
            self.outbox.put(live.error_event(req.message or f"aborted: {reason}",
                                             abort_status(reason), reason or "internal"))

    def fail(self, live: LiveRequest, reason: str, message: str, now: float) -> None:
        live.req.message = message
        self.end(live, S.FAILED, now, reason=reason)

    def _on_queue_abort(self, ab: Abort) -> None:
        live = self.lives.pop(ab.req.rid, None)
        if live is None:
            return
        if live.transfer_id is not None:  # backstop expiry during a transfer
            self.abort_transfer(live)
        self.metrics.inc_abort(ab.reason)
        self.outbox.put(live.error_event(ab.message, abort_status(ab.reason), ab.reason))

    def _check_drain(self, now: float) -> None:
        if self.drain_deadline is None or now < self.drain_deadline:
            return
        for live in list(self.lives.values()):
            self.cancel(live, "drain", now)
