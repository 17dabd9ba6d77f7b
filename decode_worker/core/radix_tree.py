"""The unified radix tree: one tree over page-aligned token keys, each node with a full value
and an SWA value (page ids), separate lock refs and separate LRU eviction per pool.

Page units everywhere. `window` is the number of earlier tokens a query sees (HF
`sliding_window - 1`; 127 for gpt-oss). Not thread-safe: the compute thread owns the tree.
Matching mutates the tree (it may split a node at the match end).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from decode_worker.core.pages import PageAllocator, PoolStats
from decode_worker.core.radix_locks import LockRef
from decode_worker.core.radix_node import Node, PageKey
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
    """A page-aligned match: `prefix_len` tokens, their full pages, their SWA pages (0 where the
    tree holds a tombstone), and the node whose end is exactly `prefix_len` (root for 0).
    `full_page_ids` and `swa_page_ids` have `prefix_len // page_size` entries each."""

    prefix_len: int
    full_page_ids: list[int]
    swa_page_ids: list[int]
    node: Node


class UnifiedRadixTree:
    """Prefix cache of full and SWA KV pages (see module docstring)."""

    def __init__(
        self, page_size: int, window: int, full: PageAllocator, swa: PageAllocator | None
    ) -> None:
        """`swa=None` for a model without SWA layers: every node is then SWA-less and RESUME
        matches need full KV only."""
        raise NotImplementedError

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
        match end. Takes no lock: call `lock(result.node)` before anything can evict."""
        raise NotImplementedError

    def lock(self, node: Node, *, swa: bool = True) -> LockRef:
        """Lock the full values on the path root -> `node` and (if `swa`) the live SWA values of
        about one window above `node`'s end. Locked pages are never evicted."""
        raise NotImplementedError

    def unlock(self, lock: LockRef, *, skip_swa: bool = False) -> None:
        """Release `lock`. The SWA part is released only if still held (after
        `release_swa_lock` it is skipped whatever `skip_swa` says, so nothing is released twice).
        Raises `LockStateError` on a lock already released."""
        raise NotImplementedError

    def release_swa_lock(self, lock: LockRef) -> None:
        """Release only the SWA part of `lock` (a request decoding past its window); a no-op if
        already released."""
        raise NotImplementedError

    def insert(
        self,
        token_ids: Sequence[int],
        full_page_ids: Sequence[int],
        swa_page_ids: Sequence[int],
        swa_start: int,
        protected_len: int = 0,
        *,
        keys: Sequence[PageKey] | None = None,
    ) -> int:
        """Insert the page-aligned prefix of `token_ids`; returns the length already present.

        Ownership: pages of the first `protected_len` tokens are the tree's already. The caller's
        pages at or past `protected_len` (within the aligned length) pass to the tree: new ones are
        stored, duplicates of cached pages are freed, a tombstone whose range the caller holds live
        SWA for is healed with the caller's SWA pages. SWA pages below `swa_start` must be 0 and
        become tombstones. Pages past the aligned length are untouched (still the caller's)."""
        raise NotImplementedError

    def evict_full(self, num_pages: int) -> list[int]:
        """Evict unlocked leaves, least recently used first, until at least `num_pages` full pages
        are freed or nothing is evictable. Frees via the allocators (the leaves' SWA pages too);
        returns the full page ids freed."""
        raise NotImplementedError

    def evict_swa(self, num_pages: int) -> list[int]:
        """Tombstone unlocked live SWA values, least recently used first, until at least
        `num_pages` SWA pages are freed or none is left. Full values stay. Returns the SWA page
        ids freed."""
        raise NotImplementedError

    def cache_unfinished_req(self, kv: ReqKV) -> None:
        """Insert a running request's page-aligned KV, free its duplicates, repoint `kv`'s page
        tables onto the cache-owned pages, move its lock to the node at the aligned end, and set
        `kv.cache_protected_len` to the aligned length."""
        raise NotImplementedError

    def cache_finished_req(self, kv: ReqKV, *, insert: bool = True) -> None:
        """A request leaves: insert its page-aligned KV (or not), free every page it still owns
        (the unaligned tail, preallocated pages, or all of `[protected, end)` without insert),
        release its lock, and empty `kv`'s page tables."""
        raise NotImplementedError

    def full_stats(self) -> PoolStats:
        """Full-pool accounting (page units)."""
        raise NotImplementedError

    def swa_stats(self) -> PoolStats:
        """SWA-pool accounting (page units); all zero without an SWA pool."""
        raise NotImplementedError

    def check_integrity(
        self, held_full: Collection[int] = (), held_swa: Collection[int] = ()
    ) -> None:
        """Verify every invariant; raise `FatalError` on the first broken one.

        `held_full` / `held_swa` are all pages owned outside the tree (by requests, in flight):
        they must be allocated, not referenced by the tree, and account exactly for
        `total - available - evictable - protected` of each pool."""
        raise NotImplementedError
