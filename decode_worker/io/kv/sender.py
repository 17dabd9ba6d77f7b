"""Prefill side of a KV transfer: plan the byte spans, post the WRITEs, wait for them.

Planning is pure (`plan_writes`); `KVSender` posts and waits. For a request with prompt length
L, reused prefix P and window start S (both page-aligned, given by the decode side):

    logical pages  0 ....... P/ps ....... S/ps ....... cdiv(L, ps)
    full pool               |--- sent, every full layer ----|
    swa pool                              |-- sent, every swa layer --|
    aux                     one row (first token) -> decode's aux_row

Per layer, a run of pages consecutive on both sides becomes one descriptor (`coalesce`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from decode_worker.errors import TransferError
from decode_worker.io.kv.nixl_agent import (
    CopySpan,
    NixlAgent,
    WriteSide,
    XferHandle,
    XferState,
    coalesce,
)
from decode_worker.io.kv.protocol import Notif, RegionLayout, TransferRequest, encode_notif
from decode_worker.utils.mathx import cdiv


@dataclass(frozen=True, slots=True)
class SourcePages:
    """The prefill side's own copy of a prompt: one page id per logical page of [0, L) in each
    pool (SWA ids before the window start are never read) and its aux row."""

    full_page_ids: list[int]
    swa_page_ids: list[int]
    aux_row: int


@dataclass(frozen=True, slots=True)
class WritePlan:
    """The WRITEs of one transfer, one per (source, destination) memory pairing."""

    writes: list[tuple[WriteSide, list[CopySpan]]]

    @property
    def num_bytes(self) -> int:
        return sum(s.length for _, spans in self.writes for s in spans)

    @property
    def num_descriptors(self) -> int:
        return sum(len(spans) for _, spans in self.writes)


def plan_writes(
    req: TransferRequest,
    page_size: int,
    src: dict[str, RegionLayout],
    dst: dict[str, RegionLayout],
    pages: SourcePages,
) -> WritePlan:
    """Turn a (validated) request into WRITEs. Raises TransferError if the two sides' regions
    disagree on layer count or row size, or the source pages do not cover the prompt."""
    n_pages = cdiv(req.prompt_len, page_size)
    has_swa = src["swa"].num_layers > 0  # else no SWA pages move
    if len(pages.full_page_ids) < n_pages or (has_swa and len(pages.swa_page_ids) < n_pages):
        raise TransferError(f"room {req.room}: source pages do not cover {req.prompt_len} tokens")
    first_full, first_swa = req.reused_len // page_size, req.swa_window_start // page_size
    groups: dict[WriteSide, list[CopySpan]] = {}
    pools = (
        ("full", pages.full_page_ids[first_full:n_pages], req.full_page_ids),
        ("swa", pages.swa_page_ids[first_swa:n_pages] if has_swa else [], req.swa_page_ids),
        ("aux", [pages.aux_row], [req.aux_row]),
    )
    for name, src_ids, dst_ids in pools:
        s, d = src[name], dst[name]
        if (s.num_layers, s.row_bytes) != (d.num_layers, d.row_bytes):
            raise TransferError(
                f"{name} region differs: prefill {s.num_layers} layers x {s.row_bytes} B rows, "
                f"decode {d.num_layers} x {d.row_bytes} B"
            )
        side = WriteSide(s.kind, s.device_id, d.kind, d.device_id)
        groups.setdefault(side, []).extend(_layer_spans(s, d, src_ids, dst_ids))
    return WritePlan([(side, coalesce(spans)) for side, spans in groups.items() if spans])


def _layer_spans(
    s: RegionLayout, d: RegionLayout, src_ids: list[int], dst_ids: list[int]
) -> list[CopySpan]:
    return [
        CopySpan(s.row_addr(layer, a), d.row_addr(layer, b), s.row_bytes)
        for layer in range(s.num_layers)
        for a, b in zip(src_ids, dst_ids, strict=True)
    ]


class KVSender:
    """Posts a plan's WRITEs to one peer agent and waits for all of them."""

    def __init__(self, agent: NixlAgent) -> None:
        self.agent = agent

    def post(self, peer_agent: str, req: TransferRequest, plan: WritePlan) -> list[XferHandle]:
        """Post every WRITE of `plan`; each carries the notification of its part.
        Raises TransferError (after releasing what was already posted) if one fails to post."""
        handles: list[XferHandle] = []
        n = len(plan.writes)
        try:
            for part, (side, spans) in enumerate(plan.writes):
                notif = encode_notif(Notif(req.transfer_id, req.room, part, n, len(spans)))
                handles.append(self.agent.post_write(peer_agent, side, spans, notif))
        except TransferError:
            self.wait(handles, timeout_s=5.0)
            raise
        return handles

    def check(self, handles: list[XferHandle]) -> XferState:
        """Non-blocking: ERR if any WRITE failed, else PROC while any is in progress, else DONE."""
        states = [self.agent.state(h) for h in handles]
        if "ERR" in states:
            return "ERR"
        return "PROC" if "PROC" in states else "DONE"

    def release(self, handles: list[XferHandle]) -> None:
        for handle in handles:
            self.agent.release(handle)

    def wait(self, handles: list[XferHandle], timeout_s: float) -> None:
        """Wait until every handle is DONE or ERR, then release them all. Posted writes cannot
        be recalled, so an abort waits here too. Raises TransferError on ERR or after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        pending = list(handles)
        error: str | None = None
        while pending:
            state = self.agent.state(pending[0])
            if state == "PROC":
                if time.monotonic() > deadline:
                    error = f"WRITEs still in progress after {timeout_s:.1f} s"
                    break
                time.sleep(0.0002)
                continue
            if state == "ERR":
                error = f"NIXL WRITE to {pending[0].peer} failed"
            pending.pop(0)
        for handle in handles:
            self.agent.release(handle)
        if error is not None:
            raise TransferError(error)
