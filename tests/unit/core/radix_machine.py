"""The base of the radix tree's hypothesis state machines (device tier in test_radix_stateful.py
and its KV-event variant, host tier in test_radix_host_stateful.py): the token strategy whose
prefixes collide, the steps both drive the tree through (allocate with eviction, admit onto a
TRANSFER match, grow by decode steps), the integrity check and the settings."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_locks import LockRef
from decode_worker.core.radix_tree import MatchResult, UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.errors import OutOfPages
from decode_worker.utils.mathx import align_down, cdiv
from tests.examples import examples

_SYSTEM = [5, 6, 7, 8, 9, 10, 11, 12]
# small vocabularies make prefixes collide, so splits, dedup and heals happen often
BASES = [_SYSTEM + [1, 2] * 12, _SYSTEM + [3, 4] * 12, [9, 9, 9] * 10]
tokens_st = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES),
    st.integers(0, 32),
    st.lists(st.integers(0, 2), max_size=10),
)


def machine_settings(full_examples: int) -> settings:
    """The budget of one machine: `examples(full_examples)` runs of 60 steps each."""
    return settings(
        max_examples=examples(full_examples),
        stateful_step_count=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


class RadixMachineBase(RuleBasedStateMachine):
    """Requests hold `ReqKV`s in `reqs`, matches hold `locks`; a subclass's `@initialize`
    calls `_start` and its rules use the steps below."""

    ps: int
    window: int
    tree: UnifiedRadixTree
    reqs: list[ReqKV]
    locks: list[LockRef]

    def _start(self, ps: int, window: int, tree: UnifiedRadixTree) -> None:
        self.ps, self.window, self.tree = ps, window, tree
        self.reqs, self.locks = [], []

    def _evicted(self, freed: list[int], *, swa: bool) -> None:
        """The model's update after `_alloc` made the tree evict `freed` (device pages)."""

    def _window_start(self, seq_len: int) -> int:
        return align_down(max(0, seq_len - 1 - max(self.window, self.ps)), self.ps)

    def _alloc(self, pool: PageAllocator, n: int) -> list[int] | None:
        """Allocate `n` pages, evicting from the right pool if short; None if it cannot."""
        short = n - pool.num_free
        if short > 0:
            swa = pool is self.tree.swa
            freed = self.tree.evict_swa(short) if swa else self.tree.evict_full(short)
            self._evicted(freed, swa=swa)
        try:
            return pool.alloc(n)
        except OutOfPages:
            return None

    def _place(self, toks: list[int], res: MatchResult, lock: LockRef) -> list[int] | None:
        """Admit `toks` onto the TRANSFER match `res` (capped at the window start, locked by
        `lock`): allocate the delta and the SWA tail and hold them in a new request; the fresh
        full pages, or None (lock released) when the pools cannot give them."""
        s = self._window_start(len(toks))
        n_pages, p = cdiv(len(toks), self.ps), res.prefix_len // self.ps
        full = self._alloc(self.tree.full, n_pages - p)
        swa = self._alloc(self.tree.swa, n_pages - s // self.ps) if full is not None else None  # type: ignore[arg-type]
        if full is None or swa is None:
            if full is not None:
                self.tree.full.free(full)
            self.tree.unlock(lock)
            return None
        kv = ReqKV(toks, res.full_page_ids + full, [0] * (s // self.ps) + swa, s)
        kv.cache_protected_len, kv.lock = res.prefix_len, lock
        self.reqs.append(kv)
        return full

    def _grow(self, kv: ReqKV, more: list[int]) -> bool:
        """Decode steps: `more` tokens, new full and SWA pages as needed; False (nothing
        changed) when the pools cannot give them."""
        need = cdiv(len(kv.token_ids) + len(more), self.ps) - len(kv.full_page_ids)
        full = self._alloc(self.tree.full, need) if need > 0 else []
        swa = self._alloc(self.tree.swa, need) if need > 0 and full is not None else []  # type: ignore[arg-type]
        if full is None or swa is None:
            if full:
                self.tree.full.free(full)
            return False
        kv.token_ids += more  # in place: the tree must hold no reference to a request's list
        kv.full_page_ids += full
        kv.swa_page_ids += swa
        return True

    def _check_integrity(self) -> None:
        """The tree's own check against the pages the requests hold."""
        held_full = [p for kv in self.reqs for p in kv.owned_full_page_ids(self.ps)]
        held_swa = [p for kv in self.reqs for p in kv.owned_swa_page_ids(self.ps)]
        self.tree.check_integrity(held_full, held_swa)
