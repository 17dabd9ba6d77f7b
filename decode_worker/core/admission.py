"""The prealloc queue: admission of decode requests by the full and the SWA page budget (pure).

Core decides, the shell acts: `pop_admitted` returns `Admit` (pages reserved, the shell posts the
transfer) or `Abort` (the shell answers the client and tells the peer). Page units throughout;
`window` = earlier tokens a query sees (127 for gpt-oss, HF `sliding_window` 128).

A request is admitted while the full and the SWA budget hold its new pages plus its growth
reserve beside those of the requests already admitted (`core/admission_budget.py`), else it
waits (FIFO head-of-line). Retracted requests are readmitted before new ones, so a retraction
cannot starve.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from decode_worker.core.admission_budget import AdmissionBudget
from decode_worker.core.admission_plan import plan_native, plan_sglang, reserved_kv
from decode_worker.core.host_tier import HostRestore
from decode_worker.core.kv_context import KVContext
from decode_worker.core.radix_locks import LockRef
from decode_worker.core.request import DecodeRequest, RequestState
from decode_worker.errors import ServiceUnavailable
from decode_worker.utils.mathx import cdiv

S = RequestState


@dataclass(frozen=True, slots=True)
class Admit:
    """Pages reserved for `req` (now RESERVED): the shell asks prefill for the full KV of
    `[prefix_len, fill_len)` into `full_page_ids`, the SWA KV of `[swa_start, fill_len)` into
    `swa_page_ids` (which start at the page holding `swa_start`: an SGLang window start is
    aligned to the prefill's page only), with `swa_start` sent explicitly.
    `req.is_resumed`: replay `output_ids[-1]`. `restore`: host hits to copy into the first
    `restore.num_pages` of `full_page_ids` before the request may run (None: none); the
    request's lock keeps those host pages until it runs or ends."""

    req: DecodeRequest
    prefix_len: int
    swa_start: int
    full_page_ids: list[int]
    swa_page_ids: list[int]
    restore: HostRestore | None = None

    def host_hit_len(self, page_size: int) -> int:
        """Tokens of `prefix_len` whose KV the host tier restores (whole pages; the rest of
        the prefix was on the device)."""
        return self.restore.num_pages * page_size if self.restore is not None else 0


@dataclass(frozen=True, slots=True)
class Abort:
    """`req` is ABORTED (its pages returned); `reason` is the metric label, `message` the cause."""

    req: DecodeRequest
    reason: str
    message: str


Decision = Admit | Abort


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """Operator limits: queue bound (then 503), deadlines for pages and for KV, the active-request
    bound (running + in transfer), and the decode growth each admitted request keeps room for."""

    max_queued: int = 1024
    queue_timeout_s: float = 60.0
    kv_timeout_s: float = 30.0
    max_active: int | None = None
    decode_reserve_tokens: int = 256
    lookahead_tokens: int = 0  # positions a step may write past the next (speculative drafts)


class PreallocQueue:
    """Requests waiting for pages, and the ledger of the requests admitted from here.

    Owns the order of waiting requests and their QUEUED -> RESERVED / ABORTED transitions; its
    `AdmissionBudget` keeps a reference to each admitted request until it stops holding pages
    (finished, aborted, retracted), to count its growth reserve. Not thread-safe (the compute
    thread owns it and `ctx`'s tree and pools).
    """

    def __init__(self, ctx: KVContext, limits: QueueLimits | None = None) -> None:
        self.ctx = ctx
        self.limits = limits or QueueLimits()
        self._budget = AdmissionBudget(ctx, self.limits.decode_reserve_tokens,
                                       self.limits.lookahead_tokens)  # the ledger
        self._waiting: deque[DecodeRequest] = deque()  # new arrivals, by arrival
        self._retracted: deque[DecodeRequest] = deque()  # readmitted first
        self._queued: dict[str, DecodeRequest] = {}  # membership (deques skip stale entries)

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def active_requests(self) -> list[DecodeRequest]:
        """Requests admitted from here that still hold pages (RESERVED .. RUNNING)."""
        return self._budget.requests()

    def num_in_transfer(self) -> int:
        return sum(r.state in (S.RESERVED, S.RECEIVING, S.READY) for r in self.active_requests())

    def get(self, rid: str) -> DecodeRequest | None:
        return self._queued.get(rid) or self._budget.get(rid)

    # -- arrivals ------------------------------------------------------------------------------
    def enqueue(self, req: DecodeRequest, now: float) -> Abort | None:
        """Queue a new (QUEUED) request. A request that can never fit is aborted at once
        (`too_large`, returned); a full queue raises `ServiceUnavailable` (nothing changes)."""
        if len(self._queued) >= self.limits.max_queued:
            raise ServiceUnavailable(f"prealloc queue full ({self.limits.max_queued} requests)")
        why = self._budget.never_fits(req)
        if why:
            return self._abort(req, now, "too_large", why)
        req.entered_at[S.QUEUED] = now
        self._enqueue(req, self._waiting)
        return None

    def requeue(self, reqs: Iterable[DecodeRequest], now: float) -> None:
        """Put RETRACTED requests back (RETRACTED -> QUEUED) ahead of new arrivals, in order;
        never refused by the queue bound."""
        for req in reqs:
            req.transition(S.QUEUED, now)
            self._budget.pop(req.rid)
            self._enqueue(req, self._retracted)

    def _enqueue(self, req: DecodeRequest, q: deque[DecodeRequest]) -> None:
        """`req` waits in `q`; its page keys are built (or extended) here: passes read them."""
        if self.ctx.tree is not None:
            req.page_keys(self.ctx.page_size)
        self._queued[req.rid] = req
        q.append(req)

    def abort_request(self, rid: str, now: float, reason: str, message: str = "") -> Abort | None:
        """Abort a request queued here or admitted from here (in any non-terminal state),
        returning its pages; None if unknown or already done. The shell decided this abort and
        counts it (`stats` counts only the aborts admission decides). The shell tells the peer,
        and must not free pages a transfer may still write: call this once the peer drained."""
        req = self._queued.pop(rid, None) or self._budget.pop(rid)
        if req is None or req.is_done:
            return None
        return self._abort(req, now, reason, message or reason, decided_here=False)

    def expire(self, now: float) -> list[Abort]:
        """Abort requests past their deadline: waiting for pages longer than `queue_timeout_s`
        (`queue_timeout`), or holding pages in RESERVED/RECEIVING longer than `kv_timeout_s`
        since admission (`kv_timeout`, pages returned)."""
        lim, out = self.limits, []
        for q in (self._retracted, self._waiting):
            for req in [r for r in q if self._queued.get(r.rid) is r]:
                if now - req.entered_at[S.QUEUED] > lim.queue_timeout_s:
                    del self._queued[req.rid]
                    msg = f"no pages for {lim.queue_timeout_s:g}s, req={req.rid}"
                    out.append(self._abort(req, now, "queue_timeout", msg))
        for req in self.active_requests():
            late = now - req.entered_at.get(S.RESERVED, now) > lim.kv_timeout_s
            if late and req.state in (S.RESERVED, S.RECEIVING):
                self._budget.remove(req.rid)
                msg = f"KV did not arrive in {lim.kv_timeout_s:g}s, req={req.rid}"
                out.append(self._abort(req, now, "kv_timeout", msg))
        self._compact()
        return out

    # -- admission -----------------------------------------------------------------------------
    def pop_admitted(self, now: float, arrivals: Iterable[DecodeRequest] = (), *,
                     expire: bool = False) -> list[Decision]:
        """One admission pass: the step's `arrivals` (new, QUEUED) join the queue first, each
        aborted at once when the queue is full (`queue_full`) or it can never fit
        (`too_large`); then waiting requests are admitted in order while both budgets allow,
        stopping at the first that does not fit (it waits). An SWA reclaim failure aborts
        only that request and the pass goes on. Returned Admits are RESERVED; Aborts are
        ABORTED. With `expire`, the deadlines' aborts (`expire`) follow the pass's decisions."""
        out: list[Decision] = []
        for new in arrivals:
            try:
                ab = self.enqueue(new, now)
            except ServiceUnavailable as exc:
                ab = self._abort(new, now, "queue_full", str(exc))
            if ab is not None:
                out.append(ab)
        self.ctx.stats.admission_passes_total += 1
        self._budget.begin_pass()  # growth reserves of this pass, summed on first need
        while (req := self._head()) is not None:
            if not self._budget.has_slot(self.limits.max_active):
                break
            d = self._try_admit(req, now)
            if d is None:
                break
            self._pop_head()
            out.append(d)
            if isinstance(d, Admit):
                self._budget.add(req, req.kv)  # type: ignore[arg-type]  # RESERVED: kv set
        if expire:
            out.extend(self.expire(now))
        return out

    def _try_admit(self, req: DecodeRequest, now: float) -> Decision | None:
        """Admit, abort (SWA reclaim failed) or None (does not fit now; nothing held).

        ```
        pos:  0 ....... prefix ........ swa_start ............ fill_len
              [ matched, locked | new full pages ......................... ]
                                          [ new SWA pages (tail, rounded up) ]
        ```
        The match may also end past `swa_start` (full KV reused further than the window start):
        the new SWA pages then cover `[swa_start, fill_len)` under the locked prefix too. An
        SGLang prefill's window follows SGLang's rule (`admission_plan.plan_sglang`).
        """
        if self._budget.still_blocked(req):
            return None  # it waited last pass and nothing it depends on changed: O(1)
        ctx, fill = self.ctx, req.fill_len
        ps, tree, swa = ctx.page_size, ctx.tree, ctx.swa
        keys = req.page_keys(ps) if tree is not None else []  # cached: built once per request
        r = (plan_sglang(ctx, req, keys) if req.sglang_page_size and swa is not None
             else plan_native(ctx, req, keys))
        need_full = cdiv(fill, ps) - r.device_prefix // ps  # the restore's pages counted
        need_swa = cdiv(fill - r.fresh_from, ps) if swa is not None else 0
        if not self._budget.fits(req, need_full, need_swa, r.swa_start):
            self._unlock(r.lock)
            self._budget.block(req)
            return None
        # a full shortfall cannot remain (the full budget counted only evictable pages); were it
        # to, `full.alloc` below raises `OutOfPages`: a broken invariant, not this request's fault
        if ctx.evict_for(need_full, need_swa) == "swa" and swa is not None:
            self._unlock(r.lock)
            msg = f"SWA eviction insufficient: needed={need_swa}, available={swa.num_free}"
            return self._abort(req, now, "swa_reclaim_insufficient", f"{msg}, req={req.rid}")
        new_full = ctx.full.alloc(need_full)
        new_swa = swa.alloc(need_swa) if swa is not None else []
        req.transition(S.RESERVED, now, kv=reserved_kv(ctx, req, r, keys, new_full, new_swa))
        ctx.stats.count_admit(fill, r.prefix, resumed=req.is_resumed)
        h = len(r.host_ids)
        restore = HostRestore(r.host_ids, new_full[:h]) if h else None
        ctx.stats.host_hit_tokens_total += h * ps
        return Admit(req, r.prefix, r.sent_start, new_full, new_swa, restore)

    # -- plumbing ------------------------------------------------------------------------------
    def _abort(self, req: DecodeRequest, now: float, reason: str, message: str, *,
               decided_here: bool = True) -> Abort:
        req.transition(S.ABORTED, now, keeper=self.ctx, reason=reason, message=message)
        if decided_here:
            self.ctx.stats.count_abort(reason)
        return Abort(req, reason, message)

    def _unlock(self, lock: LockRef | None) -> None:
        """Drop the prefix lock a failed admission took (nothing else is held yet)."""
        if lock is not None and self.ctx.tree is not None:
            self.ctx.tree.unlock(lock)

    def _head(self) -> DecodeRequest | None:
        for q in (self._retracted, self._waiting):
            while q and self._queued.get(q[0].rid) is not q[0]:
                q.popleft()
            if q:
                return q[0]
        return None

    def _pop_head(self) -> None:
        q = self._retracted if self._retracted else self._waiting
        del self._queued[q.popleft().rid]

    def _compact(self) -> None:
        for q in (self._retracted, self._waiting):
            if len(q) > 2 * len(self._queued) + 16:
                kept = [r for r in q if self._queued.get(r.rid) is r]
                q.clear()
                q.extend(kept)
