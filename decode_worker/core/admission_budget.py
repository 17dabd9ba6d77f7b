"""The prealloc queue's page budget: the ledger of admitted requests and their growth reserves
(pure). Page units throughout; `window` = earlier tokens a query sees (127 for gpt-oss, HF
`sliding_window` 128).

Budget of one pass, per pool (protected pages are never counted):
```
budget = available + evictable - sum(growth reserve of every request holding pages)
admit r  iff  new_pages(r) + reserve(r) <= budget      (else r waits: FIFO head-of-line)
```
`reserve(r)` keeps room for a request to grow while decoding: full pages for the next
`decode_reserve_tokens` tokens (capped at its `max_new_tokens`), SWA pages up to its steady-state
peak; both with `lookahead` more positions when a step may write that far ahead (speculative
decoding's drafts).
"""

from __future__ import annotations

from decode_worker.core.kv_context import KVContext
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import HOLDS_KV, DecodeRequest
from decode_worker.core.window import max_full_pages, swa_peak_pages
from decode_worker.utils.mathx import cdiv


class AdmissionBudget:
    """The requests admitted from the prealloc queue that may still hold pages (the ledger), the
    growth reserve each keeps, and whether a request fits the pools beside them.

    The ledger keeps a reference to each admitted request until it is seen to no longer hold
    pages (finished, aborted, retracted) or is removed. The reserve sum is taken once per
    admission pass (`begin_pass`), on first need, and kept current as the pass admits. Not
    thread-safe (the compute thread owns it and `ctx`'s tree and pools).
    """

    def __init__(self, ctx: KVContext, decode_reserve_tokens: int, lookahead: int = 0) -> None:
        self.ctx = ctx
        self.reserve_pages = cdiv(decode_reserve_tokens + lookahead, ctx.page_size)
        self.swa_peak = (swa_peak_pages(ctx.window, ctx.page_size, ctx.radix_cache, lookahead)
                         if ctx.swa is not None else 0)
        self._active: dict[str, DecodeRequest] = {}
        self._pass_res: list[int] | None = None
        self._blocked: tuple[DecodeRequest, tuple[int, int, int, int]] | None = None

    # -- ledger --------------------------------------------------------------------------------
    def requests(self) -> list[DecodeRequest]:
        """Requests admitted that still hold pages (RESERVED .. RUNNING)."""
        self._prune_active()
        return list(self._active.values())

    def get(self, rid: str) -> DecodeRequest | None:
        return self._active.get(rid)

    def pop(self, rid: str) -> DecodeRequest | None:
        """Forget `rid` (None if it was not in the ledger)."""
        return self._active.pop(rid, None)

    def remove(self, rid: str) -> None:
        """Forget `rid`, which must be in the ledger (KeyError otherwise)."""
        del self._active[rid]

    def has_slot(self, max_active: int | None) -> bool:
        """Fewer than `max_active` admitted requests hold pages (always, without a bound)."""
        if max_active is None or len(self._active) < max_active:
            return True
        self._prune_active()
        return len(self._active) < max_active

    def add(self, req: DecodeRequest, kv: ReqKV) -> None:
        """Enter `req` (just RESERVED with `kv`) and add its reserve to this pass's sum."""
        self._active[req.rid] = req
        res = self._pass_reserves()
        f, w = self._reserve(req, kv)
        res[0] += f
        res[1] += w

    # -- budget --------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """Start an admission pass: the reserve sum is taken again on first need."""
        self._pass_res = None

    def fits(self, req: DecodeRequest, need_full: int, need_swa: int, swa_start: int) -> bool:
        """Both budgets hold `req`'s new pages plus its growth reserve (after its prefix lock,
        so the locked prefix no longer counts as evictable). The O(active) reserve sum is taken
        only if the request would fit without it (a full pool stays cheap to poll)."""
        ctx = self.ctx
        tree, ps, swa = ctx.tree, ctx.page_size, ctx.swa
        max_full = self._max_full(req)
        full_want = need_full + max(0, min(self.reserve_pages, max_full - cdiv(req.fill_len, ps)))
        led = tree.ledger if tree is not None else None  # its counters: no stats record built
        full_room = ctx.full.num_free + (led.full_evictable if led is not None else 0)
        swa_want = swa_room = 0
        if swa is not None:
            swa_want = need_swa + max(0, min(self.swa_peak, max_full - swa_start // ps) - need_swa)
            swa_room = swa.num_free + (led.swa_evictable if led is not None else 0)
        if full_want > full_room or swa_want > swa_room:
            return False
        full_res, swa_res = self._pass_reserves()
        return full_want <= full_room - full_res and swa_want <= swa_room - swa_res

    def block(self, req: DecodeRequest) -> None:
        """`req` did not fit: remember what its verdict depended on (`seen`)."""
        self._blocked = (req, self.seen(req))

    def still_blocked(self, req: DecodeRequest) -> bool:
        """`req` was the last request refused and nothing its verdict depends on changed since
        (then a new match and `fits` would refuse it again: O(1) instead)."""
        b = self._blocked
        return b is not None and b[0] is req and b[1] == self.seen(req)

    def seen(self, req: DecodeRequest) -> tuple[int, int, int, int]:
        """What a verdict on `req` (its match, `fits`) depends on that can change while it
        waits: the tree (contents, evictable counts, locks), both pools (free pages; the growth
        of admitted requests allocates, so their reserves move with it) and `req`'s length.
        Equal values mean an equal verdict."""
        ctx = self.ctx
        return (ctx.tree.version if ctx.tree is not None else 0, ctx.full.version,
                ctx.swa.version if ctx.swa is not None else 0, req.fill_len)

    def never_fits(self, req: DecodeRequest) -> str:
        """Why `req` can never fit the pools even alone ('' if it can)."""
        need, full, swa = self._max_full(req), self.ctx.full, self.ctx.swa
        if need > full.num_total:
            return (f"request needs {need} full pages at its longest, the pool has "
                    f"{full.num_total}, req={req.rid}")
        if swa is not None and self.swa_peak > swa.num_total:
            return (f"request needs {self.swa_peak} SWA pages, the pool has "
                    f"{swa.num_total}, req={req.rid}")
        return ""

    # -- reserves ------------------------------------------------------------------------------
    def _pass_reserves(self) -> list[int]:
        if self._pass_res is None:
            self._pass_res = list(self._reserves())
        return self._pass_res

    def _reserves(self) -> tuple[int, int]:
        """Drop requests that no longer hold pages; sum the growth reserves of the rest (it runs
        over every active request each pass, so it stays one call per request)."""
        full_res = swa_res = 0
        gone: list[str] = []
        for rid, r in self._active.items():
            if r.kv is None or r.state not in HOLDS_KV:
                gone.append(rid)
                continue
            f, w = self._reserve(r, r.kv)
            full_res += f
            swa_res += w
        for rid in gone:
            del self._active[rid]
        return full_res, swa_res

    def _reserve(self, r: DecodeRequest, kv: ReqKV) -> tuple[int, int]:
        """Full and SWA pages kept free for `r` to grow: full pages for the next
        `decode_reserve_tokens` (none past its longest), SWA pages up to its lifetime peak."""
        ps = self.ctx.page_size
        max_full = max_full_pages(len(r.prompt_ids), r.max_new_tokens, ps)
        full = max(0, min(self.reserve_pages, max_full - len(kv.full_page_ids)))
        if self.ctx.swa is None:
            return full, 0
        ids, first = kv.swa_page_ids, kv.swa_start // ps
        live = len(ids) - first - ids[first:].count(0)
        return full, max(0, min(self.swa_peak, max_full - first) - live)

    def _max_full(self, req: DecodeRequest) -> int:
        return max_full_pages(len(req.prompt_ids), req.max_new_tokens, self.ctx.page_size)

    def _prune_active(self) -> None:
        gone = [rid for rid, r in self._active.items() if r.state not in HOLDS_KV]
        for rid in gone:
            del self._active[rid]
