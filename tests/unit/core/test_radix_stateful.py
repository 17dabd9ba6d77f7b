"""Hypothesis state machine: random admit/extend/cache/finish/lock/match/evict sequences against a
reference model (a dict of cached page-aligned prefixes), with `check_integrity()` after every
step. Small vocabularies make prefixes collide, so splits, dedup and heals happen often."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_locks import LockRef
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.utils.mathx import cdiv
from tests.unit.core.radix_machine import RadixMachineBase, machine_settings, tokens_st


@dataclass
class RefEntry:
    """Reference view of one cached page: its prefix's full page and SWA page (0 = tombstone)."""

    full: int
    swa: int


class RadixMachine(RadixMachineBase):
    """Reference: `cached[prefix_tuple] = RefEntry` for every cached page-aligned prefix."""

    KV_EVENTS = False  # the KV-event property test runs the same machine with events on

    @initialize(ps=st.sampled_from([1, 2, 4]), window=st.sampled_from([0, 3, 7]))
    def setup(self, ps: int, window: int) -> None:
        self._start(ps, window, UnifiedRadixTree(
            ps, window, PageAllocator(48, "full"), PageAllocator(24, "swa"),
            kv_events=self.KV_EVENTS,
        ))
        self.cached: dict[tuple[int, ...], RefEntry] = {}

    # -- helpers -------------------------------------------------------------------------------
    def _evicted(self, freed: list[int], *, swa: bool) -> None:
        self._forget(freed, swa=swa)

    def _forget(self, freed: list[int], *, swa: bool) -> None:
        """Update the reference after an eviction, checking no locked page went."""
        gone = set(freed)
        assert not gone & (self._locked_swa() if swa else self._locked_full()), "evicted a lock"
        for key, entry in list(self.cached.items()):
            if swa and entry.swa in gone:
                entry.swa = 0
            elif not swa and entry.full in gone:
                del self.cached[key]
        if not swa:  # leaves take their SWA pages along
            live = {e.swa for e in self.cached.values() if e.swa}
            for kv in self.reqs:
                for i, p in enumerate(kv.swa_page_ids[: self._prot(kv)]):
                    if p and p not in live:
                        kv.swa_page_ids[i] = 0

    def _locked_full(self) -> set[int]:
        locked = {p for kv in self.reqs for p in kv.full_page_ids[: self._prot(kv)]}
        return locked | {p for lk in self.locks for p in self._path_full(lk)}

    def _locked_swa(self) -> set[int]:
        """SWA pages of the last window below each request's protected end (its lock span)."""
        locked: set[int] = set()
        for kv in self.reqs:
            if kv.lock is not None and kv.lock.swa_held:
                prot = self._prot(kv)
                lo = max(kv.swa_start // self.ps, prot - cdiv(self.window, self.ps))
                locked |= {p for p in kv.swa_page_ids[lo:prot] if p}
        return locked

    def _prot(self, kv: ReqKV) -> int:
        return kv.cache_protected_len // self.ps

    def _path_full(self, lock: LockRef) -> list[int]:
        node, out = lock.node, []
        while node.parent is not None:
            out += node.full
            node = node.parent
        return out

    def _record(self, kv: ReqKV) -> None:
        """Reference effect of inserting `kv`'s aligned prefix (dedup keeps cached pages)."""
        live_from = max(kv.swa_start, kv.cache_protected_len) // self.ps
        toks = kv.token_ids
        for i in range(len(toks) // self.ps):
            key = tuple(toks[: (i + 1) * self.ps])
            swa = kv.swa_page_ids[i] if i >= live_from else 0
            entry = self.cached.get(key)
            if entry is None:
                self.cached[key] = RefEntry(kv.full_page_ids[i], swa)
            elif entry.swa == 0 and swa:
                entry.swa = swa

    def _expected(self, toks: list[int], mode: MatchMode, cap: int) -> int:
        best, run, clean, i = 0, 0, True, 0
        while (i + 1) * self.ps <= min(len(toks), cap):
            entry = self.cached.get(tuple(toks[: (i + 1) * self.ps]))
            if entry is None:
                break
            i += 1
            run, clean = (run + self.ps, clean) if entry.swa else (0, False)
            if mode is MatchMode.TRANSFER or self.window == 0 or clean or run >= self.window:
                best = i * self.ps
        return best

    # -- rules ---------------------------------------------------------------------------------
    @rule(toks=tokens_st)
    def admit(self, toks: list[int]) -> None:
        """TRANSFER match capped at S, lock, allocate the delta and the SWA tail."""
        s = self._window_start(len(toks))
        res = self.tree.match_prefix(toks, MatchMode.TRANSFER, max_len=s)
        assert res.prefix_len == self._expected(toks, MatchMode.TRANSFER, s)
        self._place(toks, res, self.tree.lock(res.node))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache_unfinished(self, data: st.DataObject) -> None:
        kv = data.draw(st.sampled_from(self.reqs))
        self._record(kv)
        self.tree.cache_unfinished_req(kv)
        n = len(kv.token_ids) // self.ps
        assert kv.cache_protected_len == n * self.ps
        for i in range(n):
            assert kv.full_page_ids[i] == self.cached[tuple(kv.token_ids[: (i + 1) * self.ps])].full

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, data: st.DataObject, more: list[int]) -> None:
        """Decode steps: new pages as needed, out-of-window SWA pages of the request freed."""
        kv = data.draw(st.sampled_from(self.reqs))
        if not self._grow(kv, more):
            return
        frontier = max(kv.swa_start, self._window_start(len(kv.token_ids)))
        lo = max(kv.swa_start, kv.cache_protected_len) // self.ps
        old = [p for p in kv.swa_page_ids[lo : frontier // self.ps] if p]
        self.tree.swa.free(old)  # type: ignore[union-attr]
        for i in range(lo, frontier // self.ps):
            kv.swa_page_ids[i] = 0
        kv.swa_start = frontier

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data: st.DataObject, insert: bool) -> None:
        kv = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(kv)
        if insert:
            self._record(kv)
        self.tree.cache_finished_req(kv, insert=insert)
        assert kv.full_page_ids == [] and kv.lock is None

    @precondition(lambda self: any(kv.lock and kv.lock.swa_held for kv in self.reqs))
    @rule(data=st.data())
    def release_swa(self, data: st.DataObject) -> None:
        kv = data.draw(st.sampled_from([k for k in self.reqs if k.lock and k.lock.swa_held]))
        self.tree.release_swa_lock(kv.lock)  # type: ignore[arg-type]

    @rule(
        toks=tokens_st, mode=st.sampled_from(MatchMode), cap=st.integers(0, 48), lock=st.booleans()
    )
    def match(self, toks: list[int], mode: MatchMode, cap: int, lock: bool) -> None:
        res = self.tree.match_prefix(toks, mode, max_len=cap)
        assert res.prefix_len == self._expected(toks, mode, cap)
        for i, page in enumerate(res.full_page_ids):
            entry = self.cached[tuple(toks[: (i + 1) * self.ps])]
            assert page == entry.full and res.swa_page_ids[i] == entry.swa
        if lock:
            self.locks.append(self.tree.lock(res.node, swa=mode is MatchMode.RESUME))

    @precondition(lambda self: self.locks)
    @rule(data=st.data(), early=st.booleans())
    def unlock(self, data: st.DataObject, early: bool) -> None:
        lock = data.draw(st.sampled_from(self.locks))
        self.locks.remove(lock)
        if early:
            self.tree.release_swa_lock(lock)
        self.tree.unlock(lock, skip_swa=early)

    @rule(n=st.integers(1, 12))
    def evict_full(self, n: int) -> None:
        self._forget(self.tree.evict_full(n), swa=False)

    @rule(n=st.integers(1, 12))
    def evict_swa(self, n: int) -> None:
        self._forget(self.tree.evict_swa(n), swa=True)

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "tree"):
            return
        self._check_integrity()
        tree_pages = {e.full for e in self.cached.values()}
        assert len(tree_pages) == len(self.cached)
        stats = self.tree.full_stats()
        assert stats.evictable + stats.protected == len(self.cached)


RadixMachine.TestCase.settings = machine_settings(150)
TestRadixMachine = RadixMachine.TestCase
