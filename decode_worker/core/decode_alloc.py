"""Pages for the decode batch, step by step: grow, slide the SWA window, and retract (pure).

Per step, a RUNNING request writes the KV of its input token at position `n = kv.seq_len`:
```
pos:  0 ..... protected ..... F ............ n
      [ tree-owned | req-owned               | <- needs a full page (and an SWA page) when
                              F = swa_window_start(n): SWA below F is never read again
```
`window` = earlier tokens a query sees (127 for gpt-oss, HF `sliding_window` 128).

Retraction policy, when the pools stay short after evicting from the tree: retract first the
requests with the fewest generated tokens (least decode progress at stake, furthest from
finishing), and among those the longest (frees the most pages). A retracted request's computed KV
is cached in the tree (`cache_finished_req(insert=True)`) and the shell requeues it with
`PreallocQueue.requeue`; it is readmitted (matching what is still cached) before any new request.
The last running request is retracted too if it alone cannot get a page, so pages held by
requests still receiving KV can never deadlock the batch: admission keeps no request from ever
fitting alone (it aborts those at `add`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from decode_worker.core.kv_context import KVContext
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import DecodeRequest, RequestState
from decode_worker.errors import InvalidTransition

S = RequestState


@dataclass(slots=True)
class StepPlan:
    """`runnable`: RUNNING requests that hold a full (and SWA) page for position `kv.seq_len`,
    in the order given. `retracted`: now RETRACTED (KV cached, pages returned); the shell
    passes them to `PreallocQueue.requeue`."""

    runnable: list[DecodeRequest] = field(default_factory=list)
    retracted: list[DecodeRequest] = field(default_factory=list)


class DecodeAllocator:
    """Gives running requests their decode pages; owns READY -> RUNNING -> FINISHED/RETRACTED.

    Not thread-safe (the compute thread owns it and `ctx`'s tree and pools).
    """

    def __init__(self, ctx: KVContext) -> None:
        self.ctx = ctx

    def start_running(self, req: DecodeRequest, now: float) -> None:
        """READY -> RUNNING: insert the received prompt KV into the tree (the one place a
        prompt enters the cache), moving the request's lock onto it."""
        req.transition(S.RUNNING, now)
        if self.ctx.tree is not None and req.kv is not None:
            self.ctx.tree.cache_unfinished_req(req.kv)

    def finish(self, req: DecodeRequest, now: float) -> None:
        """RUNNING -> FINISHED: cache the computed KV, return the rest, drop the lock."""
        req.transition(S.FINISHED, now, releaser=self.ctx)

    def prepare_step(self, running: Sequence[DecodeRequest], now: float,
                     in_flight: Collection[str] = ()) -> StepPlan:
        """Slide every request's SWA window, then give each the page its next position needs,
        evicting from the tree and then retracting (see the module policy) when short.
        `in_flight`: rids with a launched step not yet committed (overlapped scheduling): their
        next position is `kv.seq_len + 1` (the window still slides by `kv.seq_len`, which the
        launched step reads). Raises `InvalidTransition` for a request that is not RUNNING."""
        for req in running:
            if req.state is not S.RUNNING or req.kv is None:
                raise InvalidTransition(f"req={req.rid}: prepare_step in {req.state.value}")
            self._slide_window(req.kv)
        plan = StepPlan(runnable=list(running))
        while self.ctx.evict_for(*self._needs(plan.runnable, in_flight)):  # a pool is short
            victim = min(plan.runnable, key=_retract_order)
            plan.runnable.remove(victim)
            victim.transition(S.RETRACTED, now, releaser=self.ctx)
            plan.retracted.append(victim)
            self.ctx.stats.retractions_total += 1
        for req in plan.runnable:
            self._grow(req.kv, req.rid in in_flight)  # type: ignore[arg-type]  # RUNNING: kv
        return plan

    # -- internals -----------------------------------------------------------------------------
    def _needs(self, reqs: Sequence[DecodeRequest], in_flight: Collection[str]
               ) -> tuple[int, int]:
        """Full and SWA pages the next step of `reqs` needs."""
        ps, has_swa, n_full, n_swa = self.ctx.page_size, self.ctx.swa is not None, 0, 0
        for req in reqs:
            kv = req.kv
            assert kv is not None  # RUNNING holds kv (checked in prepare_step)
            idx = (kv.seq_len + (req.rid in in_flight)) // ps
            n_full += idx >= len(kv.full_page_ids)
            n_swa += has_swa and idx >= len(kv.swa_page_ids)
        return n_full, n_swa

    def _grow(self, kv: ReqKV, ahead: bool) -> None:
        ctx = self.ctx
        idx = (kv.seq_len + ahead) // ctx.page_size
        if idx >= len(kv.full_page_ids):
            kv.full_page_ids += ctx.full.alloc(1)
            ctx.stats.decode_pages_allocated_total += 1
        if ctx.swa is not None and idx >= len(kv.swa_page_ids):
            kv.swa_page_ids += [0] * (idx - len(kv.swa_page_ids)) + ctx.swa.alloc(1)
            ctx.stats.decode_pages_allocated_total += 1

    def _slide_window(self, kv: ReqKV) -> None:
        """Drop SWA below the frontier F = swa_window_start(seq_len): free the request's own
        pages there; once F passes the tree-owned prefix, release the SWA part of the prefix lock
        (early release) and forget those tree pages (the tree may tombstone them)."""
        ctx = self.ctx
        if ctx.swa is None:
            return
        ps = ctx.page_size
        frontier = ctx.swa_start(kv.seq_len)
        prot = kv.cache_protected_len
        if frontier <= kv.swa_start or frontier < prot:
            return  # nothing new out of the window, or the lock still covers it
        ids = kv.swa_page_ids
        lo, hi = max(kv.swa_start, prot) // ps, frontier // ps
        own = [p for p in ids[lo:hi] if p]
        if own:
            ctx.swa.free(own)
            ctx.stats.swa_pages_released_total += len(own)
        ids[:hi] = [0] * hi
        if ctx.tree is not None and kv.lock is not None:
            ctx.tree.release_swa_lock(kv.lock)  # a no-op once released
        kv.swa_start = frontier


def _retract_order(req: DecodeRequest) -> tuple[int, int]:
    """Smaller retracts first: fewest generated tokens, then the longest sequence."""
    return (len(req.output_ids), -req.fill_len)
