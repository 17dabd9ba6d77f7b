"""Each running request's row of the persistent decode inputs, kept in step with its pages.

A request gets a row (`DecodeSlots` slot) at its first step: its whole page table and its input
token are written once. After that a step writes only what changed: the full page the core just
added, the SWA page that joined the window (a page that left the window needs no write: the
SWA ring's column is reused by the next page).
```
SWA ring of R columns, position p:  page i = p // page_size sits in column i % R;
columns hold pages [i - R + 1, i], a superset of the window's [(p - window) // page_size, i]
``` The page lists only grow at the end while a
request runs (the tree repoints them once, at `start_running`, before the first step), so the
written lengths say what is new. A request that leaves the batch (finished, aborted, retracted)
loses its row at the next step; a readmitted one gets a fresh row. Compute thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import DecodeRequest
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.device.decode_slots import DecodeSlots


class SampleKind(enum.IntEnum):
    """How a request's tokens are chosen; a batch takes its rows' largest kind."""

    GREEDY = 0  # argmax on the device
    DEVICE = 1  # `Sampler.choose` on the device
    HOST = 2  # `Sampler.sample`, waiting for the step (logprobs, grammar)


@dataclass(slots=True)
class _Row:
    slot: int
    kind: SampleKind
    kv: ReqKV  # the page lists the row mirrors (a readmitted request has new ones)
    num_full: int = 0  # full pages written to the row
    num_swa: int = 0  # SWA page-list entries written (the ring keeps the window's)


class StepRows:
    """request -> row of `slots` (by identity: a rid may come back in a new request);
    `classify` gives a new request's `SampleKind` (once)."""

    def __init__(self, slots: DecodeSlots, classify: Callable[[LiveRequest], SampleKind]
                 ) -> None:
        self.slots, self.classify = slots, classify
        self.rows: dict[DecodeRequest, _Row] = {}

    def sync(self, lives: list[LiveRequest], positions: list[int]
             ) -> tuple[list[int], SampleKind]:
        """The row of each of `lives` (RUNNING, in batch order, stepping at `positions`), with
        their new pages queued for writing, and the batch's sample kind; rows of requests not
        in `lives` go back first. SWA pages are written up to the position's page only (the
        ring holds the window's pages, not pages held ahead of it)."""
        rows, slots = self.rows, self.slots
        if len(rows) > len(lives) or any(lv.req not in rows for lv in lives):
            keep = {lv.req for lv in lives}
            for req in [r for r in rows if r not in keep]:
                slots.release(rows.pop(req).slot)
        out, kind = [], SampleKind.GREEDY
        ps = self.slots.page_size
        for live, pos in zip(lives, positions, strict=True):
            req, kv = live.req, live.req.kv
            assert kv is not None  # RUNNING holds kv
            row = rows.get(req)
            if row is None or row.kv is not kv:  # new, or readmitted with new pages
                if row is not None:
                    slots.release(row.slot)
                row = rows[req] = _Row(slots.acquire(), self.classify(live), kv)
                slots.write_token(row.slot, live.req.output_ids[-1])
            full, swa = kv.full_page_ids, kv.swa_page_ids
            if len(full) > row.num_full:
                slots.write_full(row.slot, row.num_full, full[row.num_full:])
                row.num_full = len(full)
            num_swa = min(len(swa), pos // ps + 1)
            if num_swa > row.num_swa:
                slots.write_swa(row.slot, row.num_swa, swa[row.num_swa:num_swa])
                row.num_swa = num_swa
            out.append(row.slot)
            kind = max(kind, row.kind)
        return out, kind
