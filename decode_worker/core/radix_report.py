"""What the unified radix tree tells routers (split from `radix_tree` by responsibility): the KV
events of its full-attention pages (`take_events`), a snapshot of every page as stores
(`snapshot_events`) and page-granular leaf trimming (`_trim_leaf`, for `evict_full`).

See `radix_events` for the event records and the page-hash recipe.
"""

from __future__ import annotations

from decode_worker.core.radix_base import TreeBase
from decode_worker.core.radix_events import MEDIUM_GPU, BlockStored, KVEvent, key_tokens
from decode_worker.core.radix_events import digest_to_int64 as _int64
from decode_worker.core.radix_node import Node


class ReportOps(TreeBase):
    """`take_events`, `snapshot_events`, `_trim_leaf` (mixed into `UnifiedRadixTree`)."""

    @property
    def kv_events_enabled(self) -> bool:
        """Whether the tree records KV events (fixed at construction)."""
        return self.events.enabled

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (SGLang's `take_events`);
        [] when the tree records none. Call once per step, on the thread that owns the tree."""
        return self.events.take()

    def snapshot_events(self) -> list[BlockStored]:
        """Every full-attention page the tree holds now, as `BlockStored` events, parents before
        children: applied to an empty index they give exactly the tree's pages (a consumer
        that fell behind rebuilds from them). [] when the tree records no events. Reads only."""
        if not self.events.enabled:
            return []
        out: list[BlockStored] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            parent = node.parent
            prior = parent.hashes[-1] if parent is not None and parent.hashes else None
            out.append(BlockStored([_int64(d) for d in node.hashes],
                                   _int64(prior) if prior is not None else None,
                                   key_tokens(node.key, self.page_size), self.page_size,
                                   MEDIUM_GPU))
            stack.extend(node.children.values())
        return out

    def _trim_leaf(self, node: Node, num_pages: int, freed: list[int],
                   swa_freed: list[int]) -> None:
        """Drop the last `num_pages` pages (fewer than it has) of the unlocked leaf `node` (just
        popped from the leaf heap, so it is requeued): their full and SWA pages are appended to
        `freed` / `swa_freed` for the caller to free; records their removal."""
        keep = len(node.key) - num_pages
        ledger = self.ledger
        self.events.removed(node.hashes[keep:])
        freed.extend(node.full[keep:])
        node.key, node.full, node.hashes = node.key[:keep], node.full[:keep], node.hashes[:keep]
        ledger.full_evictable -= num_pages
        if node.swa is not None:  # unlocked (full_lock == 0 >= swa_lock): evictable SWA pages
            swa_freed.extend(node.swa[keep:])
            node.swa = node.swa[:keep]
            ledger.swa_evictable -= num_pages
        ledger.add_leaf(node)
