"""Hypothesis state machine for the host tier under the unified radix tree: random admissions
(with host hits locked and restored), decode growth, inserts, finishes and aborts, matches,
locks, device and host evictions, under each write policy, with `check_integrity()` after every
step.

Page *contents* are modelled: every device and host page carries the page keys of the prefix
whose KV it holds (what a transfer, a decode step, a write or a restore would put there). After
every step each node's device pages and host pages must hold exactly its own prefix: a write
that copied the wrong pages, a restore into the wrong pages, a page shared by two nodes or a
page reused while still in the tree all show up as a wrong content.

The tree records KV events: after every step an index rebuilt from the events alone holds
exactly the tree's device pages as medium `GPU` and its host copies as `CPU_PINNED` (demotion
is a removal from one and a store in the other), and so does one rebuilt from a snapshot; its
match across media (device pages, then host pages) equals the tree's device + host hits.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from decode_worker.core.host_tier import HostRestore, Transition, WritePolicy
from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_events import MEDIUM_CPU_PINNED, MEDIUM_GPU
from decode_worker.core.radix_locks import LockRef
from decode_worker.core.radix_node import Node, PageKey, page_keys
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.errors import OutOfPages
from decode_worker.utils.mathx import align_down, cdiv
from tests.examples import examples
from tests.unit.core.test_radix_events_stateful import tree_entries

_SYSTEM = [5, 6, 7, 8, 9, 10, 11, 12]
BASES = [_SYSTEM + [1, 2] * 12, _SYSTEM + [3, 4] * 12, [9, 9, 9] * 10]
tokens_st = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES),
    st.integers(0, 32),
    st.lists(st.integers(0, 2), max_size=10),
)
Content = tuple[PageKey, ...]


class HostTierMachine(RuleBasedStateMachine):
    """Requests hold `ReqKV`s; `dev` / `host` map page ids to their modelled content."""

    @initialize(
        ps=st.sampled_from([1, 2, 4]),
        window=st.sampled_from([0, 3, 7]),
        policy=st.sampled_from(WritePolicy),
        num_host=st.sampled_from([6, 16, 40]),
    )
    def setup(self, ps: int, window: int, policy: WritePolicy, num_host: int) -> None:
        self.ps, self.window = ps, window
        self.tree = UnifiedRadixTree(
            ps, window, PageAllocator(12, "full"), PageAllocator(24, "swa"),
            host=PageAllocator(num_host, "host"), write_policy=policy, kv_events=True,
        )
        self.index = KVEventIndex()
        self.transitions: list[Transition] = []
        self.tree.host_listener = lambda t: self.transitions.append(t.kind)
        self.dev: dict[int, Content] = {}
        self.host: dict[int, Content] = {}
        self.reqs: list[ReqKV] = []
        self.restores: dict[int, HostRestore] = {}  # id(kv) -> its restore (until it runs)
        self.locks: list[LockRef] = []

    # -- helpers -------------------------------------------------------------------------------
    def _content(self, toks: list[int], i: int) -> Content:
        return tuple(page_keys(toks[: (i + 1) * self.ps], self.ps))

    def _drain(self) -> None:
        """What the shell does before any device page is written again: make the copies."""
        for w in self.tree.take_host_writes():
            for d, h in zip(w.device_page_ids, w.host_page_ids, strict=True):
                self.host[h] = self.dev[d]

    def _alloc(self, pool: PageAllocator, n: int) -> list[int] | None:
        short = n - pool.num_free
        if short > 0:
            if pool is self.tree.full:
                self.tree.evict_full(short)
            else:
                self.tree.evict_swa(short)
        self._drain()
        try:
            return pool.alloc(n)
        except OutOfPages:
            return None

    def _window_start(self, seq_len: int) -> int:
        return align_down(max(0, seq_len - 1 - max(self.window, self.ps)), self.ps)

    # -- rules ---------------------------------------------------------------------------------
    @rule(toks=tokens_st)
    def admit(self, toks: list[int]) -> None:
        """TRANSFER match capped at S with host hits locked; the restore's pages are allocated
        with the transfer's; the restore copies host -> device at once (the shell may defer
        it: the lock keeps the host pages)."""
        s = self._window_start(len(toks))
        res = self.tree.match_prefix(toks, MatchMode.TRANSFER, max_len=s)
        self._drain()
        lock = self.tree.lock(res.host_node or res.node, swa=False)
        n_pages, p = cdiv(len(toks), self.ps), res.prefix_len // self.ps
        full = self._alloc(self.tree.full, n_pages - p)
        swa = self._alloc(self.tree.swa, n_pages - s // self.ps) if full is not None else None  # type: ignore[arg-type]
        if full is None or swa is None:
            if full is not None:
                self.tree.full.free(full)
            self.tree.unlock(lock)
            return
        h = len(res.host_page_ids)
        restore = HostRestore(res.host_page_ids, full[:h])
        for i, page in enumerate(full[h:], p + h):  # the transfer
            self.dev[page] = self._content(toks, i)
        kv = ReqKV(toks, res.full_page_ids + full, [0] * (s // self.ps) + swa, s)
        kv.cache_protected_len, kv.lock = res.prefix_len, lock
        self.reqs.append(kv)
        self.restores[id(kv)] = restore

    @precondition(lambda self: self.restores)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        kv = data.draw(st.sampled_from([k for k in self.reqs if id(k) in self.restores]))
        r = self.restores.pop(id(kv))
        for h, d in zip(r.host_page_ids, r.device_page_ids, strict=True):
            assert h in self.host, "a locked host page was freed before its restore"
            self.dev[d] = self.host[h]

    @precondition(lambda self: any(id(k) not in self.restores for k in self.reqs))
    @rule(data=st.data())
    def start_running(self, data: st.DataObject) -> None:
        """Restored (or nothing to restore): insert the prompt, as `start_running` does."""
        kv = data.draw(st.sampled_from([k for k in self.reqs if id(k) not in self.restores]))
        self.tree.cache_unfinished_req(kv)
        self._drain()

    @precondition(lambda self: any(id(k) not in self.restores for k in self.reqs))
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, data: st.DataObject, more: list[int]) -> None:
        """Decode steps: new full and SWA pages as needed, their content computed."""
        kv = data.draw(st.sampled_from([k for k in self.reqs if id(k) not in self.restores]))
        need = cdiv(len(kv.token_ids) + len(more), self.ps) - len(kv.full_page_ids)
        full = self._alloc(self.tree.full, need) if need > 0 else []
        swa = self._alloc(self.tree.swa, need) if need > 0 and full is not None else []  # type: ignore[arg-type]
        if full is None or swa is None:
            if full:
                self.tree.full.free(full)
            return
        first = len(kv.token_ids) // self.ps
        kv.token_ids = kv.token_ids + more
        kv.full_page_ids += full
        kv.swa_page_ids += swa
        for i in range(first, cdiv(len(kv.token_ids), self.ps)):
            self.dev[kv.full_page_ids[i]] = self._content(kv.token_ids, i)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data: st.DataObject, insert: bool) -> None:
        """Finish (insert) or abort (no insert; an abort may come before the restore)."""
        kv = data.draw(st.sampled_from(self.reqs))
        pending = self.restores.pop(id(kv), None)
        self.reqs.remove(kv)
        self.tree.cache_finished_req(kv, insert=insert and pending is None)
        self._drain()
        assert kv.full_page_ids == [] and kv.lock is None

    @rule(toks=tokens_st, mode=st.sampled_from(MatchMode), cap=st.integers(0, 48),
          lock=st.booleans())
    def match(self, toks: list[int], mode: MatchMode, cap: int, lock: bool) -> None:
        self.index.apply(self.tree.take_events())
        res = self.tree.match_prefix(toks, mode, max_len=cap)
        self._drain()
        if mode is MatchMode.TRANSFER and cap >= len(toks):  # device hits, then host hits
            assert self.index.match_len_across(toks) == res.total_len
        for i, page in enumerate(res.full_page_ids):
            assert self.dev[page] == self._content(toks, i)
        base = res.prefix_len // self.ps
        for i, page in enumerate(res.host_page_ids, base):
            assert self.host[page] == self._content(toks, i)
        assert mode is MatchMode.TRANSFER or not res.host_len
        assert res.total_len <= max(cap, 0)
        if lock:
            self.locks.append(self.tree.lock(res.host_node or res.node, swa=False))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        lock = data.draw(st.sampled_from(self.locks))
        self.locks.remove(lock)
        self.tree.unlock(lock)

    @rule(n=st.integers(1, 12))
    def evict_full(self, n: int) -> None:
        self.tree.evict_full(n)
        self._drain()

    @rule(n=st.integers(1, 12))
    def evict_swa(self, n: int) -> None:
        self.tree.evict_swa(n)

    @rule(n=st.integers(1, 12))
    def evict_host(self, n: int) -> None:
        self.tree.evict_host(n)

    @rule()
    def flush(self) -> None:
        self.tree.flush()  # what no lock holds, the host tier too; never writes back
        assert not self.tree.host_writes

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "tree"):
            return
        tree = self.tree
        held_full = [p for kv in self.reqs for p in kv.owned_full_page_ids(self.ps)]
        held_swa = [p for kv in self.reqs for p in kv.owned_swa_page_ids(self.ps)]
        tree.check_integrity(held_full, held_swa)
        assert not tree.host_writes  # drained after every step
        stack: list[tuple[Node, Content]] = [(tree.root, ())]
        while stack:
            node, above = stack.pop()
            for child in node.children.values():
                keys = above + tuple(child.key)
                for j in range(len(child.key)):
                    want = keys[: len(above) + j + 1]
                    if child.full is not None:
                        assert self.dev[child.full[j]] == want, "device page content"
                    if child.host is not None:
                        assert self.host[child.host[j]] == want, "host page content"
                stack.append((child, keys))
        hs = tree.host_stats_pages()
        assert hs.total == hs.available + hs.evictable + hs.protected + hs.held_by_requests
        if tree.write_policy is WritePolicy.WRITE_BACK:
            assert Transition.WRITE not in self.transitions or Transition.DEMOTE in self.transitions

    @invariant()
    def events_agree_with_both_tiers(self) -> None:
        if not hasattr(self, "tree"):
            return
        index, tree = self.index, self.tree
        index.apply(tree.take_events())
        assert (index.orphan_stores, index.duplicate_stores, index.unknown_removals) == (0, 0, 0)
        snap = KVEventIndex()
        snap.apply(tree.snapshot_events())
        for medium in (MEDIUM_GPU, MEDIUM_CPU_PINNED):
            assert index.entries(medium) == tree_entries(tree, medium), medium
            assert snap.entries(medium) == index.entries(medium), medium


HostTierMachine.TestCase.settings = settings(
    max_examples=examples(200),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHostTier = HostTierMachine.TestCase
