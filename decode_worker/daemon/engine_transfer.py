"""Getting a request's KV: post the transfer for an admitted request, turn transfer events into
arrivals or failures, or compute the prompt locally when no prefill peer was named.

A mixin of `DecodeEngine` (compute thread only; the receiver's NIXL agent has this one owner).
"""

from __future__ import annotations

import logging

from decode_worker.core.admission import Admit
from decode_worker.core.request import RequestState
from decode_worker.daemon.engine_state import EngineState
from decode_worker.daemon.live import LiveRequest, abort_status
from decode_worker.io.kv_receiver import TransferEvent

log = logging.getLogger(__name__)


class TransferOps(EngineState):
    """Transfer-side operations of the engine."""

    def fetch_kv(self, live: LiveRequest, admit: Admit, now: float) -> None:
        """The request holds its pages (RESERVED): ask its prefill peer for the missing KV, or
        compute it here when the client named no peer (or it is a resumed request)."""
        req = live.req
        live.cached_tokens = max(live.cached_tokens, admit.prefix_len)
        if not live.has_peer or req.is_resumed:
            self._compute_locally(live, admit.prefix_len, now)
            return
        slot = self.aux_slots.pop()
        self.aux.clear(slot)
        live.aux_slot = slot
        cmd = live.cmd
        live.transfer_id = self.receiver.submit(
            cmd.bootstrap_host or "", cmd.bootstrap_port or 0, rid=req.rid,
            room=cmd.bootstrap_room or 0, prompt_len=req.fill_len, reused_len=admit.prefix_len,
            swa_window_start=admit.swa_start, full_page_ids=admit.full_page_ids,
            swa_page_ids=admit.swa_page_ids, aux_slot=slot)
        self.by_transfer[live.transfer_id] = live
        req.transition(RequestState.RECEIVING, now)

    def poll_transfers(self, now: float) -> None:
        for event in self.receiver.poll():
            live = self.by_transfer.get(event.transfer_id)
            if live is None:
                continue
            if event.kind == "done":
                self._on_done(live, event, now)
            elif event.kind == "failed":
                self._on_failed(live, event)
            else:
                self._on_released(live, now)

    def abort_transfer(self, live: LiveRequest) -> None:
        """Stop waiting for this request's KV; its pages come back on "released"."""
        if live.transfer_id is not None:
            self.receiver.abort(live.transfer_id)

    def _on_done(self, live: LiveRequest, ev: TransferEvent, now: float) -> None:
        slot = live.aux_slot
        row = self.aux.check(slot, ev.room, ev.transfer_id) if slot is not None else None
        self._forget_transfer(live)
        if live.answered:  # cancelled while the last bytes landed: nobody is waiting
            self.end(live, RequestState.ABORTED, now, reason=live.req.reason or "client_abort")
            return
        if row is None:
            self.fail(live, "transfer_failed", "first token missing or for another room", now)
            return
        received = live.req.fill_len - live.cached_tokens
        self.metrics.observe_transfer(ev.num_bytes, ev.duration_s, ev.num_descriptors,
                                      num_tokens=received)
        live.record_logprobs(row.logprob, row.top_logprobs)
        live.req.arrive(row.token_id, now)

    def _on_failed(self, live: LiveRequest, ev: TransferEvent) -> None:
        """Answer the client now; the pages stay held until the peer has stopped writing."""
        reason = ev.reason or "transfer_failed"
        self.metrics.inc_transfer_failure(reason)
        log.warning("rid=%s transfer %d failed (%s): %s", live.rid, ev.transfer_id, reason,
                    ev.detail)
        if not live.answered:
            self.outbox.put(live.error_event(f"KV transfer failed ({reason}): {ev.detail}",
                                             abort_status(reason), reason))
        live.req.reason = reason

    def _on_released(self, live: LiveRequest, now: float) -> None:
        self._forget_transfer(live)
        reason = live.req.reason or "transfer_failed"
        if live.req.state in (RequestState.RESERVED, RequestState.RECEIVING):
            self.end(live, RequestState.FAILED if reason != "client_abort"
                     else RequestState.ABORTED, now, reason=reason)

    def _forget_transfer(self, live: LiveRequest) -> None:
        if live.transfer_id is not None:
            self.by_transfer.pop(live.transfer_id, None)
            live.transfer_id = None
        if live.aux_slot is not None:
            self.aux_slots.append(live.aux_slot)
            live.aux_slot = None

    def _compute_locally(self, live: LiveRequest, prefix_len: int,
                         now: float) -> None:
        """Prefill here: positions from 0, writing full KV only past the tree-owned prefix (its
        pages are shared; page 0 is the dummy page) and SWA KV into the held tail."""
        req, kv = live.req, live.req.kv
        assert kv is not None
        ps = self.page_size
        full = [0] * (prefix_len // ps) + kv.full_page_ids[prefix_len // ps:]
        swa = kv.swa_page_ids if self.swa else [0] * len(full)
        logits = self.rt.runner.prefill(req.fill_ids, full, swa, start_pos=0)
        if req.is_resumed:
            req.arrive(req.output_ids[-1], now)
            return
        out = self.sampler.sample(logits[None], [live.sample_row()])
        live.record_logprobs(out.logprobs[0], out.top_logprobs[0])
        req.arrive(out.token_ids[0], now)
