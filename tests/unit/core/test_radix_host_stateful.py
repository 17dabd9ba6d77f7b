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

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from decode_worker.core.host_tier import HostRestore, Transition, WritePolicy
from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_events import MEDIUM_CPU_PINNED, MEDIUM_GPU
from decode_worker.core.radix_node import Node, PageKey, page_keys
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from decode_worker.utils.mathx import cdiv
from tests.unit.core.radix_machine import RadixMachineBase, machine_settings, tokens_st
from tests.unit.core.test_radix_events_stateful import tree_entries

Content = tuple[PageKey, ...]


class HostTierMachine(RadixMachineBase):
    """Requests hold `ReqKV`s; `dev` / `host` map page ids to their modelled content."""

    @initialize(
        ps=st.sampled_from([1, 2, 4]),
        window=st.sampled_from([0, 3, 7]),
        policy=st.sampled_from(WritePolicy),
        num_host=st.sampled_from([6, 16, 40]),
    )
    def setup(self, ps: int, window: int, policy: WritePolicy, num_host: int) -> None:
        self._start(ps, window, UnifiedRadixTree(
            ps, window, PageAllocator(12, "full"), PageAllocator(24, "swa"),
            host=PageAllocator(num_host, "host"), write_policy=policy, kv_events=True,
        ))
        self.index = KVEventIndex()
        self.transitions: list[Transition] = []
        self.tree.host_listener = lambda t: self.transitions.append(t.kind)
        self.dev: dict[int, Content] = {}
        self.host: dict[int, Content] = {}
        self.restores: dict[int, HostRestore] = {}  # id(kv) -> its restore (until it runs)

    # -- helpers -------------------------------------------------------------------------------
    def _content(self, toks: list[int], i: int) -> Content:
        return tuple(page_keys(toks[: (i + 1) * self.ps], self.ps))

    def _drain(self) -> None:
        """What the shell does before any device page is written again: make the copies."""
        for w in self.tree.take_host_writes():
            for d, h in zip(w.device_page_ids, w.host_page_ids, strict=True):
                self.host[h] = self.dev[d]

    def _evicted(self, freed: list[int], *, swa: bool) -> None:
        self._drain()

    # -- rules ---------------------------------------------------------------------------------
    @rule(toks=tokens_st)
    def admit(self, toks: list[int]) -> None:
        """TRANSFER match capped at S with host hits locked; the restore's pages are allocated
        with the transfer's; the restore copies host -> device at once (the shell may defer
        it: the lock keeps the host pages)."""
        s = self._window_start(len(toks))
        res = self.tree.match_prefix(toks, MatchMode.TRANSFER, max_len=s)
        self._drain()
        full = self._place(toks, res, self.tree.lock(res.host_node or res.node, swa=False))
        if full is None:
            return
        h, p = len(res.host_page_ids), res.prefix_len // self.ps
        for i, page in enumerate(full[h:], p + h):  # the transfer
            self.dev[page] = self._content(toks, i)
        self.restores[id(self.reqs[-1])] = HostRestore(res.host_page_ids, full[:h])

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
        """Restored (or nothing to restore): insert the prompt, as READY -> RUNNING does."""
        kv = data.draw(st.sampled_from([k for k in self.reqs if id(k) not in self.restores]))
        self.tree.cache_unfinished_req(kv)
        self._drain()

    @precondition(lambda self: any(id(k) not in self.restores for k in self.reqs))
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, data: st.DataObject, more: list[int]) -> None:
        """Decode steps: new full and SWA pages as needed, their content computed."""
        kv = data.draw(st.sampled_from([k for k in self.reqs if id(k) not in self.restores]))
        first = len(kv.token_ids) // self.ps
        if not self._grow(kv, more):
            return
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
        self._check_integrity()
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


HostTierMachine.TestCase.settings = machine_settings(200)
TestHostTier = HostTierMachine.TestCase
