"""How an admitted request gets its KV: a transfer from its prefill peer, or a prefill here.

```
post ──► receiver.submit ──► "done"      first_token reads the aux row (landed pages are
                         │               copied out first) -> READY
                         ├─► "failed"    the request ends now; its pages wait
                         └─► "released"  the transfer stopped: the pages may go back
prefill_here (no peer, or a resumed request) ──► READY
```
An SGLang prefill of a model it lays out with full KV in every layer (Gemma 3) writes into the
landing area (`landing.py`): `post` then needs landing room, and says so when there is none yet.
The fetcher holds no request: the request table parks each one while it waits
(`parking.py`) and calls back here. It owns the aux rows a first token lands in and the
rules of what a peer's protocol allows. Compute thread only (the receiver's NIXL agent has
this one owner).
"""

from __future__ import annotations

from dataclasses import dataclass

from decode_worker.core.admission import Admit
from decode_worker.core.kv_context import KVContext
from decode_worker.core.request import RequestState
from decode_worker.daemon.decode.landing import LandingDock
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.aux_rows import FirstToken
from decode_worker.device.runner import ModelRunner
from decode_worker.device.sampler import Sampler
from decode_worker.device.sglang_aux import SglangAuxBuffers
from decode_worker.io.kv.peer import TransferEvent
from decode_worker.io.kv.router import PeerProtocol, ProtocolRouter


@dataclass(frozen=True, slots=True)
class AuxBuffers:
    """Where a transfer's first token lands: our aux rows (native peers) or SGLang's ten aux
    buffers (SGLang prefills); one row number indexes both."""

    native: AuxBuffer
    sglang: SglangAuxBuffers


class KVFetcher:
    """Transfers (through the receiver) and local prefill for admitted requests."""

    def __init__(self, receiver: ProtocolRouter, aux: AuxBuffers, kv_ctx: KVContext,
                 runner: ModelRunner, sampler: Sampler, *, sglang_all_layers: bool = False,
                 landing: LandingDock | None = None) -> None:
        """`sglang_all_layers`: SGLang lays this model out with full KV in every layer, so its
        transfers from SGLang prefills go through `landing` (refused without one)."""
        self.receiver, self.aux, self.kv_ctx = receiver, aux, kv_ctx
        self.runner, self.sampler = runner, sampler
        self.page_size = kv_ctx.page_size
        self.sglang_all_layers, self.landing = sglang_all_layers, landing
        self._free_rows = list(range(aux.native.num_rows - 1, -1, -1))

    # -- the peer's protocol -----------------------------------------------------------------
    def protocol_of(self, live: LiveRequest, since: float) -> PeerProtocol | None:
        """The protocol of `live`'s peer, or None while it is still being learned (probing
        began at `since`)."""
        return self.receiver.protocol_of(live.cmd.bootstrap_host or "",
                                         live.cmd.bootstrap_port or 0, since)

    def refusal(self, live: LiveRequest, proto: PeerProtocol) -> tuple[str, str] | None:
        """Why this worker cannot take `live`'s KV from `proto`'s peer (reason, message), or
        None (an SGLang peer's page size is then set on the request). An unavailable peer
        counts as a transfer failure."""
        if proto.kind == "unavailable":
            self.receiver.count_failure(proto.reason)
            return proto.reason, proto.detail
        if proto.kind == "sglang" and self.sglang_all_layers and self.landing is None:
            return "transfer_failed", (
                "SGLang lays this model out with full KV in every layer, and this worker has "
                "no landing area to take it in (transfer.sglang_landing_tokens=0): set it "
                "(docs/DEPLOY.md, \"Gemma 3 and a stock SGLang prefill\")")
        ps, ours = proto.prefill_page_size, self.page_size
        if proto.kind == "sglang" and ps is not None and ps != ours:
            if ours % ps:
                return "transfer_failed", (
                    f"SGLang prefill page size {ps} does not divide the decode page size "
                    f"{ours}: set the prefill's --page-size to {ours} (or a divisor), or "
                    f"cache.page_size")
            if self.kv_ctx.radix_cache:
                return "transfer_failed", (
                    f"SGLang prefill page size {ps} differs from the decode page size {ours} "
                    f"with the decode radix cache on: its SWA window starts inside a decode "
                    f"page, which the tree cannot cache; set the prefill's --page-size {ours}, "
                    f"or cache.page_size={ps}, or cache.decode_radix_cache=false")
        if proto.kind == "sglang":
            live.req.sglang_page_size = ps or ours
        return None

    # -- a transfer ----------------------------------------------------------------------------
    def lands(self, live: LiveRequest) -> bool:
        """`live`'s KV comes through the landing area (an SGLang prefill, all layers)."""
        return self.landing is not None and bool(live.req.sglang_page_size)

    def landing_refusal(self, live: LiveRequest, admit: Admit) -> str | None:
        """Why `admit`'s transfer can never get landing room, or None."""
        return self.landing.refusal(admit) if self.landing and self.lands(live) else None

    def post(self, live: LiveRequest, admit: Admit, now: float) -> bool:
        """Ask `live`'s peer for the KV its pages (RESERVED) lack: RECEIVING, with
        `live.transfer_id` and its aux row set. False (nothing posted) while the landing area
        has too little room for it: post it again later. Raises DecodeWorkerError for inputs
        the receiver refuses (nothing posted)."""
        req, cmd = live.req, live.cmd
        # the first pages of `full_page_ids` take the host tier's restore; the peer sends
        # [prefix_len, fill_len) into the rest
        sent_full = admit.full_page_ids[admit.restore.num_pages if admit.restore else 0:]
        full_ids, swa_ids, plan = sent_full, admit.swa_page_ids, None
        if self.landing is not None and self.lands(live):  # every layer lands there first
            plan = self.landing.take(admit, sent_full)
            if plan is None:
                return False
            full_ids, swa_ids = list(plan.page_ids), []
        row = self._free_rows.pop()
        (self.aux.sglang if req.sglang_page_size else self.aux.native).clear(row)
        try:
            tid = self.receiver.submit(
                cmd.bootstrap_host or "", cmd.bootstrap_port or 0, rid=req.rid,
                room=cmd.bootstrap_room or 0, prompt_len=req.fill_len,
                reused_len=admit.prefix_len, swa_window_start=admit.swa_start,
                full_page_ids=full_ids, swa_page_ids=swa_ids, aux_row=row)
        except BaseException:
            self._free_rows.append(row)
            if plan is not None and self.landing is not None:
                self.landing.give_back(plan)
            raise
        if plan is not None and self.landing is not None:
            self.landing.hold(tid, plan)
        live.transfer_id, live.aux_row = tid, row
        req.transition(RequestState.RECEIVING, now)
        return True

    def events(self) -> list[TransferEvent]:
        return self.receiver.take_events()

    def transfer_over(self, live: LiveRequest, ev: TransferEvent) -> FirstToken | None:
        """`live`'s transfer stopped ("done" or "released"): its id, aux row and landing pages
        are free. For "done", the first token as its aux row holds it (None: missing, or
        another room's); a live request's landed KV is in its pages by then (copied out)."""
        row, live.transfer_id, live.aux_row = live.aux_row, None, None
        first = self._first_token(live, ev, row)
        if self.landing is not None:
            self.landing.finish(ev.transfer_id, copy=first is not None and live.ended is None)
        if row is not None:
            self._free_rows.append(row)
        return first

    def _first_token(self, live: LiveRequest, ev: TransferEvent,
                     row: int | None) -> FirstToken | None:
        if row is None or ev.kind != "done":
            return None
        if ev.protocol == "sglang":
            return self.aux.sglang.check(row, ev.room, live.cmd.top_logprobs)
        # the peer wrote the id it was sent, not the router's (they part after a failure the
        # router answers itself, e.g. an unreachable peer)
        return self.aux.native.check(row, ev.room, ev.wire_id or ev.transfer_id)

    @staticmethod
    def arrive(live: LiveRequest, first: FirstToken, now: float) -> None:
        """READY with the first token (and its logprobs) the peer sent."""
        live.record_logprobs(first.logprob, first.top_logprobs)
        live.req.transition(RequestState.READY, now, first_token=first.token_id)

    # -- a prefill here ------------------------------------------------------------------------
    def prefill_here(self, live: LiveRequest, prefix_len: int, now: float) -> None:
        """READY after a prefill on this worker's model: positions from 0, full KV written only
        past the tree-owned prefix (its pages are shared; page 0 is the dummy page) and SWA KV
        into the held tail. A resumed request keeps its own last token."""
        req, kv = live.req, live.req.kv
        assert kv is not None  # RESERVED holds kv
        ps = self.page_size
        full = [0] * (prefix_len // ps) + kv.full_page_ids[prefix_len // ps:]
        swa = kv.swa_page_ids if self.kv_ctx.swa else [0] * len(full)
        logits = self.runner.prefill(req.fill_ids, full, swa, start_pos=0)
        if req.is_resumed:  # it keeps its own last token
            req.transition(RequestState.READY, now)
            return
        out = self.sampler.sample(logits[None], [live.sample_row()])
        live.record_logprobs(out.logprobs[0], out.top_logprobs[0])
        req.transition(RequestState.READY, now, first_token=out.token_ids[0])
