"""The unified radix tree: one tree over page-aligned token keys, each node with a full value
and an SWA value (page ids), separate lock refs and separate LRU eviction per pool.

Page units everywhere. `window` is the number of earlier tokens a query sees (HF
`sliding_window - 1`; 127 for gpt-oss). Not thread-safe: the compute thread owns the tree.
Matching mutates the tree (it may split a node at the match end).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from decode_worker.core.pages import PageAllocator, PoolStats
from decode_worker.core.radix_check import check_tree
from decode_worker.core.radix_evict import EvictOps
from decode_worker.core.radix_insert import InsertOps
from decode_worker.core.radix_locks import LockOps
from decode_worker.core.radix_node import Node, PageKey, path_values, path_values_of
from decode_worker.core.radix_report import ReportOps
from decode_worker.core.req_kv import ReqKV


class MatchMode(enum.Enum):
    """What a match must guarantee.

    - TRANSFER: a new request whose SWA tail `[S, L)` arrives fresh from prefill: only full KV is
      needed, so the match counts full values, ignores SWA liveness, and is capped at `max_len`
      (the window start S).
    - RESUME: a request that continues without a transfer: full KV plus live SWA for the last
      `window` tokens before the match end are required.
    """

    TRANSFER = "transfer"
    RESUME = "resume"


@dataclass(frozen=True, slots=True)
class MatchResult:
    """A page-aligned match: `prefix_len` tokens on the device (device hits), their full pages,
    their SWA pages (0 where the tree holds a tombstone), and the node whose end is exactly
    `prefix_len` (root for 0). `full_page_ids` and `swa_page_ids` have `prefix_len //
    page_size` entries each. With a host tier, a TRANSFER match also reports the host hits
    that follow: `host_len` tokens whose full KV is in host pages `host_page_ids`, ending at
    `host_node` (None when `host_len == 0`); lock `host_node` to keep them."""

    prefix_len: int
    full_page_ids: list[int]
    swa_page_ids: list[int]
    node: Node
    host_len: int = 0
    host_page_ids: list[int] = field(default_factory=list)
    host_node: Node | None = None

    @property
    def total_len(self) -> int:
        """Device hits plus host hits."""
        return self.prefix_len + self.host_len


class UnifiedRadixTree(InsertOps, EvictOps, LockOps, ReportOps):
    """Prefix cache of full and SWA KV pages (see module docstring).

    Accounting per pool: `total == available + evictable + protected + held_by_requests`, where
    evictable/protected count tree-owned pages (unlocked/locked) and the rest is allocated but
    owned outside the tree. Construction: `UnifiedRadixTree(page_size, window, full, swa,
    kv_events=False)` with `window` in tokens (HF `sliding_window - 1`), `swa=None` for a model
    without SWA layers, and `kv_events` to record KV events (`take_events`, `radix_events`).
    """

    # -- match -------------------------------------------------------------------------------
    def match_prefix(
        self,
        token_ids: Sequence[int],
        mode: MatchMode,
        max_len: int | None = None,
        *,
        keys: Sequence[PageKey] | None = None,
    ) -> MatchResult:
        """Longest cached page-aligned prefix of `token_ids` valid for `mode`, capped at
        `align_down(max_len)`. Refreshes LRU state on the matched path; may split the node at the
        match end. Takes no lock: call `lock(result.node)` (or `lock(result.host_node)` to keep
        the host hits too) before anything can evict. Host hits count only for TRANSFER (SWA
        is device-only); with a write-through policy a match counts a hit on its device nodes
        and may queue host writes."""
        ks = self._keys(token_ids, keys)
        limit = len(ks) if max_len is None else min(len(ks), max(0, max_len) // self.page_size)
        self._tick += 1
        path = self._walk(ks, limit)
        hpath: list[Node] = []
        if self.host is not None and self._has_host_only():  # else every node is on the device
            dev = 0
            while dev < len(path) and path[dev].full is not None:
                dev += 1
            if dev < len(path):
                path, hpath = path[:dev], (path[dev:] if mode is MatchMode.TRANSFER else [])
        if mode is MatchMode.RESUME and self.swa is not None:
            path = path[: self._resume_depth(path)]
        node = path[-1] if path else self.root
        self._touch(path + hpath)
        full, swa = path_values_of(path)
        ps = self.page_size
        if self.host is not None:
            self._count_hits(path)
            if hpath:
                host_ids = [p for n in hpath for p in n.host]  # type: ignore[union-attr]
                return MatchResult(len(full) * ps, full, swa, node, len(host_ids) * ps,
                                   host_ids, hpath[-1])
        return MatchResult(len(full) * ps, full, swa, node)

    def flush(self) -> tuple[list[int], list[int]]:
        """Evict everything no lock holds: full values with their SWA values, then the SWA
        values left on locked nodes. Returns (full, SWA) page ids freed. Records
        `AllBlocksCleared` when the tree is empty afterwards, else the removals."""
        full = self.evict_full(self.full.num_total, write_back=False)
        swa = self.evict_swa(self.swa.num_total) if self.swa is not None else []
        if self.host is not None:  # the host tier too, as SGLang's /flush_cache
            self.evict_host(self.host.num_total)
        if not self.root.children:
            self.events.cleared()
        return full, swa

    # -- requests ----------------------------------------------------------------------------
    def cache_unfinished_req(self, kv: ReqKV) -> None:
        """Insert a running request's page-aligned KV, free its duplicates, repoint `kv`'s page
        tables onto the cache-owned pages, move its lock to the node at the aligned end (taking the
        new lock before dropping the old), and set `kv.cache_protected_len` to the aligned
        length. The request keeps its pages past the aligned end. SWA entries below
        `kv.swa_start` become 0 (the tree may tombstone them at any time)."""
        keys = kv.keys(self.page_size)
        _, node = self._insert(keys, kv.full_page_ids, kv.swa_page_ids, kv.swa_start,
                               kv.cache_protected_len, kv.swa_owned_from)
        n = len(keys)
        full, swa = path_values(node)
        kv.full_page_ids[:n] = full
        if self.swa is not None:
            lo = min(kv.swa_start // self.page_size, n)
            kv.swa_page_ids[:n] = [0] * lo + swa[lo:]  # below the window start: not the req's
        new = self.lock(node)
        if kv.lock is not None:
            self.unlock(kv.lock)
        kv.lock = new
        kv.cache_protected_len = n * self.page_size
        kv.swa_owned_from = None

    def cache_finished_req(self, kv: ReqKV, *, insert: bool = True) -> None:
        """A request leaves: insert its page-aligned KV (or not), free every page it still owns
        (the unaligned tail, preallocated pages, or all of `[protected, end)` without insert),
        release its lock, and empty `kv`'s page tables (so a second call frees nothing)."""
        ps = self.page_size
        keep, swa_keep = kv.cache_protected_len // ps, kv.swa_owned_len() // ps
        if insert:
            keys = kv.keys(ps)
            self._insert(keys, kv.full_page_ids, kv.swa_page_ids, kv.swa_start,
                         kv.cache_protected_len, kv.swa_owned_from)
            keep = swa_keep = len(keys)
        self.full.free(kv.full_page_ids[keep:])
        if self.swa is not None:
            self.swa.free([p for p in kv.swa_page_ids[swa_keep:] if p])
        if kv.lock is not None:
            self.unlock(kv.lock)
        kv.lock = None
        kv.full_page_ids = []
        kv.swa_page_ids = []
        kv.cache_protected_len = 0
        kv.swa_owned_from = None

    # -- accounting --------------------------------------------------------------------------
    def full_stats(self) -> PoolStats:
        """Full-pool accounting (page units)."""
        led = self.ledger
        return _stats(self.full, led.full_evictable, led.full_protected)

    def swa_stats(self) -> PoolStats:
        """SWA-pool accounting (page units); all zero without an SWA pool."""
        if self.swa is None:
            return PoolStats(0, 0, 0, 0, 0)
        led = self.ledger
        return _stats(self.swa, led.swa_evictable, led.swa_protected)

    def host_stats_pages(self) -> PoolStats:
        """Host-pool accounting (page units): `evictable` = host-only unlocked, `protected` =
        host-only locked, `held_by_requests` = host copies of device nodes; all zero without
        a host tier."""
        host = self.host
        if host is None:
            return PoolStats(0, 0, 0, 0, 0)
        used = host.num_total - host.num_free
        ev = self.ledger.host_evictable
        pr = self.ledger.host_protected
        return PoolStats(host.num_total, host.num_free, ev, pr, used - ev - pr)

    def check_integrity(
        self, held_full: Collection[int] = (), held_swa: Collection[int] = ()
    ) -> None:
        """Verify every invariant; raise `FatalError` on the first broken one.

        `held_full` / `held_swa` are all pages owned outside the tree (by requests, in flight):
        they must be allocated, not referenced by the tree, and account exactly for
        `total - available - evictable - protected` of each pool."""
        check_tree(self, held_full, held_swa)


def _stats(pool: PageAllocator, evictable: int, protected: int) -> PoolStats:
    total, available = pool.num_total, pool.num_free
    held = total - available - evictable - protected
    return PoolStats(total, available, evictable, protected, held)
