"""Shared builders for the admission / decode-allocator tests (pure core, real pools and tree)."""

from __future__ import annotations

from dataclasses import dataclass

from decode_worker.core.admission import Admit, PreallocQueue, QueueLimits
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.request import DecodeRequest, RequestState, StepCommit, held_page_ids
from decode_worker.core.stats import SchedulerStats

PS, WIN = 64, 127


@dataclass
class Rig:
    ctx: KVContext
    queue: PreallocQueue
    dec: DecodeAllocator

    @property
    def full(self) -> PageAllocator:
        return self.ctx.full

    @property
    def swa(self) -> PageAllocator | None:
        return self.ctx.swa

    @property
    def tree(self) -> UnifiedRadixTree | None:
        return self.ctx.tree

    @property
    def stats(self) -> SchedulerStats:
        return self.ctx.stats

    def check(self, reqs: list[DecodeRequest]) -> None:
        """Pages and lock refs balance: the tree's integrity with every request-held page."""
        held_full, held_swa = held_page_ids(reqs, self.ctx.page_size)
        if self.tree is not None:
            self.tree.check_integrity(held_full, held_swa)
            return
        self.full.check_integrity()
        assert self.full.num_free + len(held_full) == self.full.num_total
        if self.swa is not None:
            self.swa.check_integrity()
            assert self.swa.num_free + len(held_swa) == self.swa.num_total


def make_rig(
    full_pages: int = 64,
    swa_pages: int | None = 16,
    *,
    radix: bool = True,
    page_size: int = PS,
    window: int = WIN,
    tree_cls: type[UnifiedRadixTree] = UnifiedRadixTree,
    **limits: object,
) -> Rig:
    full = PageAllocator(full_pages, "full")
    swa = PageAllocator(swa_pages, "swa") if swa_pages is not None else None
    tree = tree_cls(page_size, window, full, swa) if radix else None
    ctx = KVContext(tree, full, swa, page_size=page_size, window=window, radix_cache=radix)
    queue = PreallocQueue(ctx, QueueLimits(**limits))  # type: ignore[arg-type]
    return Rig(ctx, queue, DecodeAllocator(ctx))


def req(rid: str, n: int, *, base: int = 0, max_new: int = 8) -> DecodeRequest:
    """A request with prompt `base .. base+n-1` (same `base`: shared prefixes)."""
    return DecodeRequest(rid, hash(rid) & 0xFFFF, list(range(base, base + n)), max_new)


def admit_one(rig: Rig, r: DecodeRequest, now: float = 0.0) -> Admit:
    assert rig.queue.enqueue(r, now) is None
    (d,) = rig.queue.pop_admitted(now)
    assert isinstance(d, Admit), d
    return d


def run_to_finish(rig: Rig, r: DecodeRequest, steps: int = 1, now: float = 1.0) -> None:
    """Transfer done -> running -> `steps` decode steps -> finished."""
    r.transition(RequestState.READY, now, first_token=10**6)
    r.transition(RequestState.RUNNING, now, keeper=rig.dec.ctx)
    for i in range(steps):
        plan = rig.dec.prepare_step([r], now)
        assert plan.runnable == [r]
        StepCommit([r]).commit([i])
    r.transition(RequestState.FINISHED, now, keeper=rig.dec.ctx)
