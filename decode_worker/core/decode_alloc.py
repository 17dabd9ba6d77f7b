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
fitting alone (it aborts those at `enqueue`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from decode_worker.core.kv_context import KVContext
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import DecodeRequest, RequestState
from decode_worker.core.window import swa_slide_at
from decode_worker.errors import InvalidTransition

S = RequestState
NEVER = 1 << 62  # a position no request reaches


@dataclass(slots=True)
class StepPlan:
    """`runnable`: RUNNING requests that hold a full (and SWA) page for position `kv.seq_len`,
    in the order given. `retracted`: now RETRACTED (KV cached, pages returned); the shell
    passes them to `PreallocQueue.requeue`."""

    runnable: list[DecodeRequest] = field(default_factory=list)
    retracted: list[DecodeRequest] = field(default_factory=list)


class DecodeAllocator:
    """Gives running requests their decode pages, and retracts some (RUNNING -> RETRACTED)
    when the pools stay short. Starting and ending a request are its own transitions
    (`DecodeRequest.transition` with the `KVContext` as keeper).

    Not thread-safe (the compute thread owns it and `ctx`'s tree and pools).
    """

    def __init__(self, ctx: KVContext) -> None:
        self.ctx = ctx

    def cache_computed(self, req: DecodeRequest) -> None:
        """A RUNNING request ends while a launched step still uses its pages: insert its
        computed page-aligned KV into the tree now (the tree's events of this step name it, so
        they are published before its answer leaves), as `cache_unfinished_req`. It keeps its
        lock and the pages past the aligned end (the launched step writes only there) until
        the request's end (FINISHED, ABORTED) releases them, which then inserts nothing new. A
        duplicate page it held is freed now: the launched step still reads it, but that row's
        token is dropped. A no-op without a tree or outside RUNNING."""
        if req.kv is not None and req.state is S.RUNNING:
            self.ctx.cache_unfinished(req.kv)

    def prepare_step(self, running: Sequence[DecodeRequest], now: float,
                     ahead: Mapping[str, int] | None = None) -> StepPlan:
        """Slide every request's SWA window, then give each the pages its step writes,
        evicting from the tree and then retracting (see the module policy) when short.
        `ahead`: per rid, how far past `kv.seq_len` its step writes (absent: 0, the next
        position only): 1 for a launched step not yet committed (overlapped scheduling), plus
        its draft tokens when it verifies a draft; the window still slides by `kv.seq_len`.
        Raises `InvalidTransition` for a request that is not RUNNING."""
        for req in running:
            if req.state is not S.RUNNING or req.kv is None:
                raise InvalidTransition(f"req={req.rid}: prepare_step in {req.state.value}")
        self.slide(running)
        plan = StepPlan(runnable=list(running))
        while True:
            need = self._needs(plan.runnable, ahead or {})
            if not self.ctx.evict_for(len(need.full), len(need.swa)):
                break
            victim = min(plan.runnable, key=_retract_order)  # a pool is short
            plan.runnable.remove(victim)
            victim.transition(S.RETRACTED, now, keeper=self.ctx)
            plan.retracted.append(victim)
            self.ctx.stats.retractions_total += 1
        self._grow(need)
        return plan

    # -- the batch-level scheduler's pieces of `prepare_step` -----------------------------------
    # A scheduler that knows which requests are at a page edge (`slide_due_at`, `edge`) calls
    # these for those only: `prepare_step` over the batch does the same for the rest (nothing).
    def slide(self, reqs: Sequence[DecodeRequest]) -> None:
        """Slide the SWA window of RUNNING `reqs` to their `kv.seq_len` (a no-op for a request
        whose `slide_due_at` is past its `kv.seq_len`)."""
        ctx = self.ctx
        if ctx.swa is None:
            return
        freed: list[int] = []
        for req in reqs:
            self._slide_window(req.kv, freed)  # type: ignore[arg-type]  # RUNNING: kv
        if freed:
            ctx.swa.free(freed)
            ctx.stats.swa_pages_released_total += len(freed)

    def grow(self, reqs: Sequence[DecodeRequest], ahead: Mapping[str, int] | None = None
             ) -> bool:
        """Give each of RUNNING `reqs` the pages its step writes (`ahead` as in `prepare_step`;
        evicting from the tree when short); False, with nothing given, when a pool stays short:
        then `prepare_step` over the whole batch retracts."""
        need = self._needs(reqs, ahead or {})
        if self.ctx.evict_for(len(need.full), len(need.swa)):
            return False
        self._grow(need)
        return True

    def slide_due_at(self, kv: ReqKV) -> int:
        """The `kv.seq_len` at which `slide` next changes `kv` (returns or releases SWA pages);
        a huge number without SWA layers. Exact: below it `slide` is a no-op."""
        ctx = self.ctx
        if ctx.swa is None:
            return NEVER
        ps = ctx.page_size
        # _slide_window acts once the frontier passes kv.swa_start and reaches the lock's end
        target = max(kv.swa_start + ps, kv.cache_protected_len)
        return swa_slide_at(target, ctx.window, ps, ctx.radix_cache)

    # -- internals -----------------------------------------------------------------------------
    def _needs(self, reqs: Sequence[DecodeRequest], ahead: Mapping[str, int]) -> _Needs:
        """The full pages and the SWA pages (with their indices) the requests' steps write and
        they do not hold yet, in page order per request."""
        ps, has_swa, need = self.ctx.page_size, self.ctx.swa is not None, _Needs([], [])
        for req in reqs:
            kv = req.kv
            assert kv is not None  # RUNNING holds kv (checked in prepare_step)
            n = len(kv.token_ids)
            first, last = n // ps, (n + ahead.get(req.rid, 0)) // ps  # the pages written
            need.full += [kv] * (last + 1 - len(kv.full_page_ids))
            if has_swa:
                need.swa += [(kv, i) for i in range(max(len(kv.swa_page_ids), first), last + 1)]
        return need

    def _grow(self, need: _Needs) -> None:
        """Hand out what `need` counts (the pools hold it: `evict_for` said so)."""
        ctx = self.ctx
        for kv, page in zip(need.full, ctx.full.alloc(len(need.full)), strict=True):
            kv.full_page_ids.append(page)
        if need.swa:
            assert ctx.swa is not None
            for (kv, idx), page in zip(need.swa, ctx.swa.alloc(len(need.swa)), strict=True):
                ids = kv.swa_page_ids
                if idx > len(ids):
                    ids += [0] * (idx - len(ids))
                ids.append(page)
        ctx.stats.decode_pages_allocated_total += len(need.full) + len(need.swa)

    def _slide_window(self, kv: ReqKV, freed: list[int]) -> None:
        """Drop SWA below the frontier F = swa_window_start(seq_len): the request's own pages
        there go to `freed` (the caller frees them); once F passes the tree-owned prefix, release
        the SWA part of the prefix lock (early release) and forget those tree pages (the tree
        may tombstone them). Needs SWA layers."""
        ctx = self.ctx
        ps = ctx.page_size
        frontier = ctx.swa_start(kv.seq_len)
        prot = kv.cache_protected_len
        if frontier <= kv.swa_start or frontier < prot:
            return  # nothing new out of the window, or the lock still covers it
        ids = kv.swa_page_ids
        lo, hi = max(kv.swa_start, prot) // ps, frontier // ps
        freed += [p for p in ids[lo:hi] if p]
        first = kv.swa_start // ps  # entries below the old window start are 0 already
        ids[first:hi] = [0] * (hi - first)
        if ctx.tree is not None and kv.lock is not None:
            ctx.tree.release_swa_lock(kv.lock)  # a no-op once released
        kv.swa_start = frontier


@dataclass(slots=True)
class _Needs:
    full: list[ReqKV]  # one entry per full page a request needs (its next ones, in order)
    swa: list[tuple[ReqKV, int]]  # one per SWA page, with its logical page index (ascending)


def _retract_order(req: DecodeRequest) -> tuple[int, int]:
    """Smaller retracts first: fewest generated tokens, then the longest sequence."""
    return (len(req.output_ids), -req.fill_len)
