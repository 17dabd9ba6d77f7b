"""Fixed-size page allocator for one KV pool (full or SWA), and the per-pool stats record.

Page ids are ints in `[1, num_pages]`; page 0 is reserved (the dummy page for CUDA-graph padding
and "no page" in an SWA page table) and is never handed out. Everything is in page units.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from decode_worker.errors import FatalError, OutOfPages, PageError

_HELD = 0
_FREE = 1


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Page accounting of one pool; `total == available + evictable + protected + held`.

    - `available`: free in the allocator;
    - `evictable`: owned by the radix tree and unlocked (can be reclaimed by eviction);
    - `protected`: owned by the radix tree and locked by some request;
    - `held_by_requests`: allocated, not in the tree (owned by requests, in flight, ...).
    """

    total: int
    available: int
    evictable: int
    protected: int
    held_by_requests: int


class PageAllocator:
    """Hands out and takes back whole pages of one pool.

    Allocation is LIFO over a free stack, initially ascending (fresh pools give contiguous runs).
    `alloc` never hands out a page twice; `free` of a page that is not held raises `PageError`
    and leaves the allocator unchanged. Not thread-safe: one owner (the compute thread).
    """

    def __init__(self, num_pages: int, name: str) -> None:
        if num_pages < 0:
            raise PageError(f"pool {name!r}: num_pages must be >= 0, got {num_pages}")
        self.name = name
        self._num_pages = num_pages
        self._free: list[int] = list(range(num_pages, 0, -1))  # stack: pops 1, 2, 3, ...
        self._state = bytearray([_FREE]) * (num_pages + 1)  # index 0 unused (reserved page)
        self.version = 0  # bumped by every alloc and free that moves a page

    @property
    def num_total(self) -> int:
        """Pages in the pool, page 0 excluded."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages that `alloc` can hand out now."""
        return len(self._free)

    def is_free(self, page_id: int) -> bool:
        """True if `page_id` is in the free list; raises `PageError` if out of range."""
        self._check_range(page_id)
        return self._state[page_id] == _FREE

    def all_held(self, page_ids: Iterable[int]) -> bool:
        """True if every id is in range and allocated (0 and out-of-range ids are not held)."""
        ids = page_ids if isinstance(page_ids, list | tuple) else list(page_ids)
        if not ids:
            return True
        if min(ids) < 1 or max(ids) > self._num_pages:
            return False
        return not any(map(self._state.__getitem__, ids))  # _HELD == 0: C-speed scan

    def alloc(self, n: int) -> list[int]:
        """Take `n` pages; raises `OutOfPages` (nothing taken) if fewer than `n` are free."""
        if n <= 0:
            if n < 0:
                raise PageError(f"pool {self.name!r}: alloc of a negative count {n}")
            return []
        free = self._free
        if n > len(free):
            raise OutOfPages(f"pool {self.name!r}: asked for {n} pages, {len(free)} free")
        pages = free[-n:]
        del free[-n:]
        self.version += 1
        pages.reverse()
        state = self._state
        for p in pages:
            state[p] = _HELD
        return pages

    def free(self, page_ids: Iterable[int]) -> None:
        """Return pages; raises `PageError` (allocator unchanged) on a page out of range, not
        held, or listed twice."""
        ids = list(page_ids)
        if not ids:
            return
        if not self.all_held(ids) or len(set(ids)) != len(ids):
            raise PageError(f"pool {self.name!r}: {self._first_bad(ids)}")
        state = self._state
        for p in ids:
            state[p] = _FREE
        self._free.extend(ids)
        self.version += 1

    def _first_bad(self, ids: list[int]) -> str:
        """Why `free(ids)` is refused (the first offending id)."""
        seen: set[int] = set()
        for p in ids:
            if not 1 <= p <= self._num_pages:
                return f"page {p} out of range [1, {self._num_pages}]"
            if p in seen or self._state[p] != _HELD:
                return f"free of page {p}, which is not held"
            seen.add(p)
        return "bad free"  # unreachable: all_held and the duplicate check found something

    def check_integrity(self) -> None:
        """Raise `FatalError` unless the free stack and the page states agree exactly."""
        free = self._free
        if len(set(free)) != len(free):
            raise FatalError(f"pool {self.name!r}: a page is twice in the free list")
        if any(p < 1 or p > self._num_pages for p in free):
            raise FatalError(f"pool {self.name!r}: free list holds an out-of-range page")
        n_free_state = self._state.count(_FREE) - 1  # index 0 is marked free and unused
        if n_free_state != len(free) or any(self._state[p] != _FREE for p in free):
            raise FatalError(f"pool {self.name!r}: free list and page states disagree")

    def _check_range(self, page_id: int) -> None:
        if not 1 <= page_id <= self._num_pages:
            raise PageError(
                f"pool {self.name!r}: page {page_id} out of range [1, {self._num_pages}]"
            )
