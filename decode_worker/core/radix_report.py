"""What the unified radix tree tells routers (split from `radix_tree` by responsibility): the KV
events of its full-attention pages (`take_events`), and a snapshot of every page as stores
(`snapshot_events`).

See `radix_events` for the event records and the page-hash recipe.
"""

from __future__ import annotations

from decode_worker.core.radix_base import TreeBase
from decode_worker.core.radix_events import MEDIUM_CPU_PINNED, MEDIUM_GPU, BlockStored, KVEvent


class ReportOps(TreeBase):
    """`take_events`, `snapshot_events` (mixed into `UnifiedRadixTree`)."""

    @property
    def kv_events_enabled(self) -> bool:
        """Whether the tree records KV events (fixed at construction)."""
        return self.events.enabled

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (SGLang's `take_events`);
        [] when the tree records none. Call once per step, on the thread that owns the tree."""
        return self.events.take()

    def snapshot_events(self) -> list[BlockStored]:
        """Every full-attention page the tree holds now, as `BlockStored` events (medium `GPU`
        for device copies, `CPU_PINNED` for host copies), parents before children: applied to an
        empty index they give exactly the tree's pages (a consumer that fell behind rebuilds from
        them). [] when the tree records no events. Reads only, and hashes nothing: the events name
        the pages, whose values are computed when read (on any thread, any time later: pages
        are immutable)."""
        if not self.events.enabled:
            return []
        out: list[BlockStored] = []
        ps = self.page_size
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            run = node.run
            assert run is not None  # the tree records events: every node names its pages
            pages = (run, node.run_at, node.run_at + len(node.key))
            if node.full is not None:
                out.append(BlockStored.of_pages([pages], ps, MEDIUM_GPU))
            if node.host is not None:
                out.append(BlockStored.of_pages([pages], ps, MEDIUM_CPU_PINNED))
            stack.extend(node.children.values())
        return out
