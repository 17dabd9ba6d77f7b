"""What the unified radix tree tells routers (split from `radix_tree` by responsibility): the KV
events of its full-attention pages (`take_events`), and a snapshot of every page as stores
(`snapshot_events`).

See `radix_events` for the event records and the page-hash recipe.
"""

from __future__ import annotations

from decode_worker.core.radix_base import TreeBase
from decode_worker.core.radix_events import (
    MEDIUM_CPU_PINNED,
    MEDIUM_GPU,
    BlockStored,
    KVEvent,
    key_tokens,
)
from decode_worker.core.radix_events import digest_to_int64 as _int64


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
        them). [] when the tree records no events. Reads only."""
        if not self.events.enabled:
            return []
        out: list[BlockStored] = []
        ps = self.page_size
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            parent = node.parent
            prior = parent.hashes[-1] if parent is not None and parent.hashes else None
            parent_hash = _int64(prior) if prior is not None else None
            hashes = [_int64(d) for d in node.hashes]
            tokens = key_tokens(node.key, ps)
            if node.full is not None:
                out.append(BlockStored(hashes, parent_hash, tokens, ps, MEDIUM_GPU))
            if node.host is not None:
                out.append(BlockStored(list(hashes), parent_hash, list(tokens), ps,
                                       MEDIUM_CPU_PINNED))
            stack.extend(node.children.values())
        return out
