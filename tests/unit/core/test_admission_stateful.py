"""Property test: random arrivals, admissions, transfers, decode steps, finishes, aborts, expiry
and retractions against the real pools and tree. After every step pages and lock refs balance;
at the end, with every request gone, the pools hold only what the tree caches."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from decode_worker.core.admission import Admit
from decode_worker.core.radix_node import Node
from decode_worker.core.req_kv import ReqKV
from decode_worker.core.request import DecodeRequest, RequestState, StepCommit
from decode_worker.core.window import sglang_window_start
from decode_worker.errors import ServiceUnavailable
from tests.examples import examples
from tests.unit.core.test_admission_helpers import make_rig

S = RequestState
_rng = random.Random(7)
FAMILIES = [[_rng.randrange(50) for _ in range(80)] for _ in range(3)]  # shared prefixes


class AdmissionMachine(RuleBasedStateMachine):
    """One worker: prealloc queue + decode allocator over one tree (or none)."""

    radix = True
    swa: int | None = 14
    page_size, window = 4, 7

    def __init__(self) -> None:
        super().__init__()
        self.rig = make_rig(
            full_pages=40, swa_pages=self.swa, radix=self.radix, page_size=self.page_size,
            window=self.window, max_queued=8, queue_timeout_s=60.0, kv_timeout_s=30.0,
            decode_reserve_tokens=1,
        )
        self.now = 0.0
        self.n = 0
        self.reqs: list[DecodeRequest] = []  # every request not yet done
        self.arrivals: list[DecodeRequest] = []  # join the queue at the next pass
        self.running: list[DecodeRequest] = []

    # -- rules -----------------------------------------------------------------------------
    @rule(fam=st.integers(0, 2), cut=st.integers(0, 30), n=st.integers(1, 70),
          max_new=st.integers(1, 60), sglang=st.sampled_from([0, 1, 2]), at_pass=st.booleans())
    def arrive(self, fam: int, cut: int, n: int, max_new: int, sglang: int,
               at_pass: bool) -> None:
        """`sglang`: 0 a native peer, 1 an SGLang prefill of our page size, 2 one of half our
        page size (only without the radix cache: the engine refuses it with the cache on).
        `at_pass`: it joins the queue at the next pass (as the engine's arrivals do)."""
        self.n += 1
        prompt = FAMILIES[fam][:cut] + [100 + self.n] * max(0, n - cut)
        r = DecodeRequest(f"r{self.n}", self.n, prompt or [1], max_new)
        if sglang == 1 or (sglang == 2 and not self.radix):
            r.sglang_page_size = self.page_size // sglang
        if at_pass:
            self.arrivals.append(r)
            return
        try:
            ab = self.rig.queue.enqueue(r, self.now)
        except ServiceUnavailable:
            return
        if ab is None:
            self.reqs.append(r)

    @rule()
    def admit(self) -> None:
        arrivals, self.arrivals = self.arrivals, []
        got = self.rig.queue.pop_admitted(self.now, arrivals)
        for r in arrivals:  # queued or admitted, else aborted (queue full, too large)
            assert r.state is not S.QUEUED or self.rig.queue.get(r.rid) is r
            if r.state is not S.ABORTED:
                self.reqs.append(r)
        for d in got:
            if isinstance(d, Admit):
                # full KV is reused up to the last whole page; the SWA tail arrives fresh from
                # the window start, under the reused prefix when it starts below it
                assert d.prefix_len <= d.req.fill_len - d.req.fill_len % self.page_size
                assert d.prefix_len % self.page_size == 0
                kv = d.req.kv
                assert kv is not None
                if self.rig.swa is not None:
                    _check_window(d, kv, self.page_size, self.window)

    @rule(pick=st.integers(0, 10**6), done=st.booleans())
    def transfer_progress(self, pick: int, done: bool) -> None:
        cand = [r for r in self.reqs if r.state in (S.RESERVED, S.RECEIVING)]
        if cand:
            r = cand[pick % len(cand)]
            if done:
                r.transition(RequestState.READY, self.now, first_token=pick % 50)
            elif r.state is S.RESERVED:
                r.transition(S.RECEIVING, self.now)

    @rule(pick=st.integers(0, 10**6))
    def transfer_fails(self, pick: int) -> None:
        cand = [r for r in self.reqs if r.state in (S.RESERVED, S.RECEIVING)]
        if cand:
            r = cand[pick % len(cand)]
            r.transition(S.FAILED, self.now, keeper=self.rig.ctx, reason="transfer_failed")

    @rule()
    def join_batch(self) -> None:
        for r in [r for r in self.reqs if r.state is S.READY]:
            r.transition(RequestState.RUNNING, self.now, keeper=self.rig.dec.ctx)
            self.running.append(r)

    @precondition(lambda self: bool(self.running))
    @rule(tok=st.integers(0, 49))
    def decode_step(self, tok: int) -> None:
        plan = self.rig.dec.prepare_step(self.running, self.now)
        self.rig.queue.requeue(plan.retracted, self.now)
        self.running = plan.runnable
        StepCommit(self.running).commit([tok] * len(self.running))
        for r in list(self.running):
            if len(r.output_ids) >= r.max_new_tokens:
                r.transition(RequestState.FINISHED, self.now, keeper=self.rig.dec.ctx)
                self.running.remove(r)

    @rule(steps=st.integers(1, 30), tok=st.integers(0, 49))
    def drive(self, steps: int, tok: int) -> None:
        """Everything moves on: admit, transfers land, the batch joins and decodes."""
        for _ in range(steps):
            self.admit()
            for r in self.reqs:
                if r.state in (S.RESERVED, S.RECEIVING):
                    r.transition(RequestState.READY, self.now, first_token=tok)
            self.join_batch()
            if self.running:
                self.decode_step(tok)
            self.now += 0.01

    @rule(pick=st.integers(0, 10**6))
    def client_abort(self, pick: int) -> None:
        live = [r for r in self.reqs if not r.is_done]
        if live and pick % 3 == 0:
            r = live[pick % len(live)]
            assert self.rig.queue.abort_request(r.rid, self.now, "client_abort") is not None
            if r in self.running:
                self.running.remove(r)

    @rule(dt=st.sampled_from([0.5, 3.0, 40.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        for ab in self.rig.queue.expire(self.now):
            assert ab.reason in ("queue_timeout", "kv_timeout")

    # -- checks ----------------------------------------------------------------------------
    @invariant()
    def pages_and_locks_balance(self) -> None:
        self.reqs = [r for r in self.reqs if not r.is_done]
        self.rig.check(self.reqs)
        for r in self.reqs:
            assert (r.kv is not None) == (r.state in (S.RESERVED, S.RECEIVING, S.READY, S.RUNNING))
            if r.kv is not None:  # every page it reads (its own or the tree's) is still held
                assert self.rig.full.all_held(r.kv.full_page_ids)
                if self.rig.swa is not None:
                    assert self.rig.swa.all_held([p for p in r.kv.swa_page_ids if p])
        if self.rig.tree is not None:
            _check_full_lock_refs(self.rig.tree.root, self.reqs)

    def teardown(self) -> None:
        for r in list(self.reqs):
            if not r.is_done:
                self.rig.queue.abort_request(r.rid, self.now, "drain")
        self.rig.check([])
        tree = self.rig.tree
        if tree is not None:
            for stats in (tree.full_stats(), tree.swa_stats()):
                assert stats.protected == 0 and stats.held_by_requests == 0
                assert stats.available + stats.evictable == stats.total
        else:
            assert self.rig.full.num_free == self.rig.full.num_total


def _check_window(d: Admit, kv: ReqKV, ps: int, window: int) -> None:
    """The SWA the first query reads, `[fill - window, fill)`, is held (live tree pages or new
    ones); new SWA pages start at the page of the window start sent to the peer, which follows
    SGLang's rule for an SGLang prefill; the request owns exactly the new pages."""
    fill = d.req.fill_len
    first = (max(fill - window, 0) // ps) * ps
    assert all(kv.swa_page_ids[first // ps : -(-fill // ps)])
    sent_page = d.swa_start - d.swa_start % ps
    assert len(d.swa_page_ids) == -(-(fill - sent_page) // ps)
    assert kv.swa_owned_len() == min(sent_page, d.prefix_len)
    assert sorted(kv.owned_swa_page_ids(ps)) == sorted(d.swa_page_ids)
    if d.req.sglang_page_size:
        assert d.swa_start == sglang_window_start(d.prefix_len, fill, window,
                                                  d.req.sglang_page_size)


def _check_full_lock_refs(root: Node, reqs: list[DecodeRequest]) -> None:
    """Every node's full lock count equals the held locks of live requests through it."""
    want: dict[int, int] = {}
    for r in reqs:
        lock = r.kv.lock if r.kv is not None else None
        if lock is not None and lock.is_held:
            n: Node | None = lock.node
            while n is not None and n is not root:
                want[id(n)] = want.get(id(n), 0) + 1
                n = n.parent
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        assert node.full_lock == want.get(id(node), 0), node
        stack.extend(node.children.values())


_SETTINGS = settings(
    max_examples=examples(40), stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class _RadixSwa(AdmissionMachine):
    pass


class _NoRadix(AdmissionMachine):
    radix = False


class _NoSwa(AdmissionMachine):
    swa = None


class _OddWindow(AdmissionMachine):
    page_size, window = 4, 5  # a window the contract formula alone would not margin


for _m in (_RadixSwa, _NoRadix, _NoSwa, _OddWindow):
    _m.TestCase.settings = _SETTINGS

TestRadixSwa = _RadixSwa.TestCase
TestNoRadix = _NoRadix.TestCase
TestNoSwa = _NoSwa.TestCase
TestOddWindow = _OddWindow.TestCase
