"""Getting a request's KV: post the transfer for an admitted request and turn the receiver's
events into arrivals or ends, or compute the prompt here when no prefill peer was named.

```
fetch ──► receiver.submit ──► "done"      aux row checked: READY with the first token
                          ├─► "failed"    the request ends now (answered); pages wait
                          └─► "released"  pages of an ended request go back (table)
      └─► no peer, or a resumed request: prefill on this worker's model -> READY
```
The join gate: a request admitted with a host-tier restore (`live.restore`) becomes READY
only when its KV is in (transfer done, or ready to prefill locally) AND its restore is done;
until then it waits in `gated` (still RECEIVING / RESERVED), polled with the transfers.
Compute thread only (the receiver's NIXL agent has this one owner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from decode_worker.core.admission import Admit
from decode_worker.core.request import RequestState
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.device.aux_buffer import AuxBuffer, AuxRow
from decode_worker.device.runner import ModelRunner
from decode_worker.device.sampler import Sampler
from decode_worker.device.sglang_aux import SglangAuxBuffers, SglangAuxRow
from decode_worker.io.kv.peer import TransferEvent
from decode_worker.io.kv.router import PeerProtocol, ProtocolRouter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AuxRows:
    """Where a transfer's first token lands: our aux rows (native peers) or SGLang's ten aux
    buffers (SGLang prefills); one slot number indexes both."""

    native: AuxBuffer
    sglang: SglangAuxBuffers


class KVFetcher:
    """Transfers in flight by id, the aux rows (first token, logprobs) they land in, and the
    requests waiting to learn their peer's protocol (`resolving`: each with when it began
    waiting; the prealloc-queue gauge counts them)."""

    def __init__(self, receiver: ProtocolRouter, aux: AuxRows, table: RequestTable,
                 runner: ModelRunner, sampler: Sampler) -> None:
        self.receiver, self.aux, self.table = receiver, aux, table
        self.runner, self.sampler = runner, sampler
        self.page_size = table.kv_ctx.page_size
        self.by_transfer: dict[int, LiveRequest] = {}
        self.resolving: list[tuple[LiveRequest, float]] = []
        # KV in, restore not yet done: each with what makes it READY once the restore is done
        self.gated: list[tuple[LiveRequest, Callable[[float], None]]] = []
        self._free_slots = list(range(aux.native.num_rows - 1, -1, -1))

    def wait_for_peer(self, live: LiveRequest, now: float) -> None:
        """`live` waits (from `now`) until its peer's protocol is known (`resolve`)."""
        self.resolving.append((live, now))

    def resolve(self) -> list[tuple[LiveRequest, tuple[str, str] | None]]:
        """The waiting requests whose peer's protocol is now known, each with None (queue it:
        an SGLang peer's page size is set on the request) or the (reason, message) it ends
        with: an unavailable peer (unreachable: peer_dead, counted as a transfer failure) or
        one this worker cannot take KV from. Requests that ended meanwhile are dropped."""
        out, still = [], []
        for live, since in self.resolving:
            if live.ended is not None:
                continue
            proto = self.receiver.protocol_of(live.cmd.bootstrap_host or "",
                                              live.cmd.bootstrap_port or 0, since)
            if proto is None:
                still.append((live, since))
                continue
            refusal = self._refusal(proto)
            if refusal is None and proto.kind == "sglang":
                live.req.sglang_page_size = proto.prefill_page_size or self.page_size
            out.append((live, refusal))
        self.resolving = still
        return out

    def _refusal(self, proto: PeerProtocol) -> tuple[str, str] | None:
        """Why this worker cannot take KV from `proto`'s peer, or None."""
        if proto.kind == "unavailable":
            self.receiver.count_failure(proto.reason)
            return proto.reason, proto.detail
        ps, ours = proto.prefill_page_size, self.page_size
        if proto.kind != "sglang" or ps is None or ps == ours:
            return None
        if ours % ps:
            return "transfer_failed", (
                f"SGLang prefill page size {ps} does not divide the decode page size {ours}: "
                f"set the prefill's --page-size to {ours} (or a divisor), or cache.page_size")
        if self.table.kv_ctx.radix_cache:
            return "transfer_failed", (
                f"SGLang prefill page size {ps} differs from the decode page size {ours} with "
                f"the decode radix cache on: its SWA window starts inside a decode page, which "
                f"the tree cannot cache; set the prefill's --page-size {ours}, or "
                f"cache.page_size={ps}, or cache.decode_radix_cache=false")
        return None

    @property
    def num_in_flight(self) -> int:
        """Requests still getting their KV: transfers in flight, and those waiting for their
        restore (the "transfer" queue)."""
        return len(self.by_transfer) + len(self.gated)

    def fetch(self, live: LiveRequest, admit: Admit, now: float) -> None:
        """The request holds its pages (RESERVED): ask its prefill peer for the missing KV, or
        compute it here when the client named no peer (or it is a resumed request). Raises
        DecodeWorkerError for inputs the receiver refuses (nothing posted)."""
        req = live.req
        if admit.prefix_len >= live.cached_tokens:  # a readmission reports its best reuse
            live.cached_tokens = admit.prefix_len
            live.host_cached_tokens = admit.host_hit_len(self.page_size)
        if not live.has_peer or req.is_resumed:
            prefix_len = admit.prefix_len
            self._when_restored(live, lambda t: self._compute_locally(live, prefix_len, t), now)
            return
        slot = self._free_slots.pop()
        (self.aux.sglang if req.sglang_page_size else self.aux.native).clear(slot)
        cmd = live.cmd
        # the first pages of `full_page_ids` take the host tier's restore; the peer sends
        # [prefix_len, fill_len) into the rest
        sent_full = admit.full_page_ids[admit.restore.num_pages if admit.restore else 0:]
        try:
            tid = self.receiver.submit(
                cmd.bootstrap_host or "", cmd.bootstrap_port or 0, rid=req.rid,
                room=cmd.bootstrap_room or 0, prompt_len=req.fill_len,
                reused_len=admit.prefix_len, swa_window_start=admit.swa_start,
                full_page_ids=sent_full, swa_page_ids=admit.swa_page_ids, aux_row=slot)
        except BaseException:
            self._free_slots.append(slot)
            raise
        live.transfer_id, live.aux_row = tid, slot
        self.by_transfer[tid] = live
        req.transition(RequestState.RECEIVING, now)

    def poll(self, now: float) -> None:
        """Apply every transfer event the receiver has; then let the gated requests whose
        restore is done become READY, and release the pages of ended ones (table)."""
        self._poll_events(now)
        if self.gated:
            self._poll_gated(now)
        self.table.restores_done(now)

    def _when_restored(self, live: LiveRequest, make_ready: Callable[[float], None],
                       now: float) -> None:
        """Run `make_ready` now if `live` has no restore in flight, else once it is done."""
        if live.is_restoring:
            self.gated.append((live, make_ready))
            return
        live.restore = None
        make_ready(now)

    def _poll_gated(self, now: float) -> None:
        still = []
        for live, make_ready in self.gated:
            if live.ended is not None:
                continue  # it ended meanwhile: the table holds its pages until the restore ends
            if live.is_restoring:
                still.append((live, make_ready))
                continue
            live.restore = None
            make_ready(now)
        self.gated = still

    def _poll_events(self, now: float) -> None:
        for event in self.receiver.take_events():
            live = self.by_transfer.get(event.transfer_id)
            if live is None:
                continue
            if event.kind == "failed":
                self._on_failed(live, event, now)
                continue
            slot = live.aux_row
            self._forget(live, event.transfer_id)
            if self.table.transfer_over(event.transfer_id, now):
                continue  # it had ended: its pages went back
            if event.kind == "done":
                self._on_done(live, event, slot, now)
            else:  # released without a failure or an end: nothing will arrive
                self.table.end(live, "transfer_failed", "the KV transfer was released "
                               "before it completed", now, failed=True)

    def _on_done(self, live: LiveRequest, ev: TransferEvent, slot: int | None,
                 now: float) -> None:
        """KV and the aux row landed (`slot`, already back in the free list but not reused
        before this reads it)."""
        row: AuxRow | SglangAuxRow | None = None
        if slot is not None and ev.protocol == "sglang":
            row = self.aux.sglang.check(slot, ev.room, live.cmd.top_logprobs)
        elif slot is not None:
            # the peer wrote the id it was sent, not the router's (they part after a failure
            # the router answers itself, e.g. an unreachable peer)
            row = self.aux.native.check(slot, ev.room, ev.wire_id or ev.transfer_id)
        if row is None:
            self.table.end(live, "transfer_failed", "first token missing or for another room",
                           now, failed=True)
            return
        first = row
        self._when_restored(live, lambda t: self._arrive(live, first, t), now)

    def _arrive(self, live: LiveRequest, row: AuxRow | SglangAuxRow, now: float) -> None:
        live.record_logprobs(row.logprob, row.top_logprobs)
        live.req.arrive(row.token_id, now)
        self.table.arrived(live)

    def _on_failed(self, live: LiveRequest, ev: TransferEvent, now: float) -> None:
        """Answer the client now; the pages stay held until the peer has stopped writing."""
        reason = ev.reason or "transfer_failed"
        log.warning("rid=%s transfer %d failed (%s): %s", live.rid, ev.transfer_id, reason,
                    ev.detail)
        self.table.end(live, reason, f"KV transfer failed ({reason}): {ev.detail}", now,
                       failed=True)

    def _forget(self, live: LiveRequest, transfer_id: int) -> None:
        """The transfer is over: its id and aux row are free (the row was read, if needed)."""
        self.by_transfer.pop(transfer_id, None)
        live.transfer_id = None
        if live.aux_row is not None:
            self._free_slots.append(live.aux_row)
            live.aux_row = None

    def _compute_locally(self, live: LiveRequest, prefix_len: int, now: float) -> None:
        """Prefill here: positions from 0, writing full KV only past the tree-owned prefix (its
        pages are shared; page 0 is the dummy page) and SWA KV into the held tail."""
        req, kv = live.req, live.req.kv
        assert kv is not None  # RESERVED holds kv
        ps = self.page_size
        full = [0] * (prefix_len // ps) + kv.full_page_ids[prefix_len // ps:]
        swa = kv.swa_page_ids if self.table.kv_ctx.swa else [0] * len(full)
        logits = self.runner.prefill(req.fill_ids, full, swa, start_pos=0)
        if req.is_resumed:
            req.arrive(req.output_ids[-1], now)
        else:
            out = self.sampler.sample(logits[None], [live.sample_row()])
            live.record_logprobs(out.logprobs[0], out.top_logprobs[0])
            req.arrive(out.token_ids[0], now)
        self.table.arrived(live)
