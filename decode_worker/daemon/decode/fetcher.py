"""How an admitted request gets its KV: a transfer from its prefill peer, or a prefill here.

```
post ──► receiver.submit ──► "done"      first_token reads the aux row -> READY
                         ├─► "failed"    the request ends now; its pages wait
                         └─► "released"  the transfer stopped: the pages may go back
prefill_here (no peer, or a resumed request) ──► READY
```
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
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.aux_rows import FirstToken
from decode_worker.device.model.arch import sglang_layout_refusal
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
                 runner: ModelRunner, sampler: Sampler) -> None:
        self.receiver, self.aux, self.kv_ctx = receiver, aux, kv_ctx
        self.runner, self.sampler = runner, sampler
        self.page_size = kv_ctx.page_size
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
        layout = sglang_layout_refusal(self.runner.model.cfg) if proto.kind == "sglang" else None
        if layout is not None:  # it would write every layer's KV where only windows fit
            return "transfer_failed", layout
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
    def post(self, live: LiveRequest, admit: Admit, now: float) -> None:
        """Ask `live`'s peer for the KV its pages (RESERVED) lack: RECEIVING, with
        `live.transfer_id` and its aux row set. Raises DecodeWorkerError for inputs the
        receiver refuses (nothing posted)."""
        req, cmd = live.req, live.cmd
        row = self._free_rows.pop()
        (self.aux.sglang if req.sglang_page_size else self.aux.native).clear(row)
        # the first pages of `full_page_ids` take the host tier's restore; the peer sends
        # [prefix_len, fill_len) into the rest
        sent_full = admit.full_page_ids[admit.restore.num_pages if admit.restore else 0:]
        try:
            tid = self.receiver.submit(
                cmd.bootstrap_host or "", cmd.bootstrap_port or 0, rid=req.rid,
                room=cmd.bootstrap_room or 0, prompt_len=req.fill_len,
                reused_len=admit.prefix_len, swa_window_start=admit.swa_start,
                full_page_ids=sent_full, swa_page_ids=admit.swa_page_ids, aux_row=row)
        except BaseException:
            self._free_rows.append(row)
            raise
        live.transfer_id, live.aux_row = tid, row
        req.transition(RequestState.RECEIVING, now)

    def events(self) -> list[TransferEvent]:
        return self.receiver.take_events()

    def transfer_over(self, live: LiveRequest, ev: TransferEvent) -> FirstToken | None:
        """`live`'s transfer stopped ("done" or "released"): its id and aux row are free. For
        "done", the first token as its aux row holds it (None: missing, or another room's)."""
        row, live.transfer_id, live.aux_row = live.aux_row, None, None
        if row is None:
            return None
        self._free_rows.append(row)  # not reused before it is read below
        if ev.kind != "done":
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
        live.req.arrive(first.token_id, now)

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
        if req.is_resumed:
            req.arrive(req.output_ids[-1], now)
            return
        out = self.sampler.sample(logits[None], [live.sample_row()])
        live.record_logprobs(out.logprobs[0], out.top_logprobs[0])
        req.arrive(out.token_ids[0], now)
