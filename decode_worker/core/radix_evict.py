"""Device eviction of the unified radix tree: full eviction (deleting leaves, or demoting them
to host-only when they have a host copy) and SWA tombstoning. Host eviction is in
`radix_host.py`."""

from __future__ import annotations

from decode_worker.core.host_tier import Transition, WritePolicy
from decode_worker.core.radix_base import changes_tree
from decode_worker.core.radix_host import HostOps
from decode_worker.core.radix_node import Node


class EvictOps(HostOps):
    """`evict_full`, `evict_swa` (mixed into `UnifiedRadixTree`)."""

    @changes_tree
    def evict_full(self, num_pages: int, *, write_back: bool = True) -> list[int]:
        """Evict unlocked device leaves, least recently used first, until at least `num_pages`
        full pages are freed or nothing is evictable. A leaf with a host copy is *demoted*
        (kept, host-only; `write_back` makes that copy first when the host pool has room); one
        without is deleted, page-granular: when it is longer than the shortfall, only its last
        pages go (the leaf stays, shorter). Frees via the allocators (the leaves' SWA pages
        too); returns the full (device) page ids freed. Records `BlockRemoved` (GPU) for the
        pages that left the device. `write_back` False: no new host copy (a cache flush)."""
        freed: list[int] = []
        swa_freed: list[int] = []
        ledger = self.ledger
        write_back = (write_back and self.host is not None
                      and self.write_policy is WritePolicy.WRITE_BACK)
        while len(freed) < num_pages:
            node = ledger.pop_lru_leaf()
            if node is None:
                break
            full = node.full
            assert full is not None
            if write_back and node.host is None:
                self._write(node)
            k = len(node.key)
            if node.host is None and num_pages - len(freed) < k:  # trim the leaf's tail
                self._trim_leaf(node, num_pages - len(freed), freed, swa_freed)
                break
            self.events.removed(node.run, node.run_at, node.run_at + k)
            freed.extend(full)
            ledger.full_evictable -= k
            if node.swa is not None:
                swa_freed.extend(node.swa)
                ledger.swa_evictable -= k
                ledger.swa_remove(node)
                node.swa = None
                node.swa_uuid = 0
            parent = node.parent
            assert parent is not None
            if node.host is not None:
                self._demote(node, full)
            else:  # no host copy: no children either (a host child has a host parent)
                del parent.children[node.key[0]]
                node.parent = None
            if (parent is not self.root and parent.full_lock == 0
                    and not self._has_device_child(parent)):
                ledger.add_leaf(parent)
        self.full.free(freed)
        if self.swa is not None:
            self.swa.free(swa_freed)
        return freed

    def _trim_leaf(self, node: Node, num_pages: int, freed: list[int],
                   swa_freed: list[int]) -> None:
        """Drop the last `num_pages` pages (fewer than it has) of the unlocked device leaf `node`
        without a host copy (just popped from the leaf heap, so it is requeued): their full and
        SWA pages are appended to `freed` / `swa_freed` for the caller to free; records their
        removal."""
        keep = len(node.key) - num_pages
        ledger = self.ledger
        full = node.full
        assert full is not None and node.host is None
        at = node.run_at
        self.events.removed(node.run, at + keep, at + len(node.key))
        freed.extend(full[keep:])
        node.key, node.full = node.key[:keep], full[:keep]
        ledger.full_evictable -= num_pages
        if node.swa is not None:  # unlocked (full_lock == 0 >= swa_lock): evictable SWA pages
            swa_freed.extend(node.swa[keep:])
            node.swa = node.swa[:keep]
            ledger.swa_evictable -= num_pages
        ledger.add_leaf(node)

    def _demote(self, node: Node, full: list[int]) -> None:
        """`node` (unlocked, its device pages about to be freed) stays, host-only."""
        node.full = None
        k = len(node.key)
        self.ledger.host_evictable += k
        if not node.children:
            self.ledger.host_leaves.add(node)
        self.host_stats.demoted_pages_total += k
        self._emit(Transition.DEMOTE, node, full, node.host or [])

    def evict_swa(self, num_pages: int) -> list[int]:
        """Tombstone unlocked live SWA values, least recently used first, until at least
        `num_pages` SWA pages are freed or none is left. Full values stay (TRANSFER matches
        still use them). Returns the SWA page ids freed."""
        if self.swa is None or num_pages <= 0:
            return []
        return self._evict_swa(num_pages)

    @changes_tree
    def _evict_swa(self, num_pages: int) -> list[int]:
        assert self.swa is not None
        freed: list[int] = []
        ledger = self.ledger
        for node in ledger.swa_victims(num_pages):
            assert node.swa is not None
            freed.extend(node.swa)
            ledger.swa_evictable -= len(node.key)
            ledger.swa_remove(node)
            node.swa = None
            node.swa_uuid = 0
        self.swa.free(freed)
        return freed
