"""A router's view of one worker, rebuilt from its KV events alone (pure; the consumer side).

`KVEventIndex` applies `BlockStored` / `BlockRemoved` / `AllBlocksCleared` in order, exactly as a
router that indexes SGLang's events does: pages by published hash, per medium, each with its
parent link and tokens. `match_len` then predicts how many prompt tokens the worker holds, by
recomputing SGLang's page chain over the prompt (as the experimental sgl-router does);
`match_len_across` does the same over several media in order (device pages, then host pages:
what a worker with a host tier reports as cached, since it restores host hits itself).

Used by the tests (the event log must let this index agree with the tree after every step) and
by tools that route on events. It counts, never raises on, what a faithful log never does (a
store under an unknown parent, a duplicate store, a removal of an unknown page).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from decode_worker.core.radix_events import (
    MEDIUM_CPU_PINNED,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    digest_to_int64,
    page_digest,
    token_bytes,
)


@dataclass(frozen=True, slots=True)
class IndexedPage:
    """One page as the events described it."""

    parent: int | None
    token_ids: tuple[int, ...]


class KVEventIndex:
    """Pages per medium, keyed by published hash (see module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self.pages: dict[str, dict[int, IndexedPage]] = {}
        self.block_size = 0
        self.orphan_stores = 0  # a parent hash not held in that medium
        self.duplicate_stores = 0
        self.unknown_removals = 0

    def apply(self, events: Iterable[KVEvent]) -> None:
        """Apply events in order."""
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                held = self.pages.get(event.medium or MEDIUM_GPU, {})
                for h in event.block_hashes:
                    if held.pop(h, None) is None:
                        self.unknown_removals += 1
            elif isinstance(event, AllBlocksCleared):
                self.pages.clear()

    def _store(self, event: BlockStored) -> None:
        bs = event.block_size
        self.block_size = bs
        held = self.pages.setdefault(event.medium or MEDIUM_GPU, {})
        parent = event.parent_block_hash
        if parent is not None and parent not in held:
            self.orphan_stores += 1
        for i, h in enumerate(event.block_hashes):
            if h in held:
                self.duplicate_stores += 1
            held[h] = IndexedPage(parent, tuple(event.token_ids[i * bs : (i + 1) * bs]))
            parent = h

    def entries(self, medium: str = MEDIUM_GPU) -> set[tuple[int, int | None, tuple[int, ...]]]:
        """(hash, parent hash, tokens) of every page held in `medium`."""
        return {(h, p.parent, p.token_ids) for h, p in self.pages.get(medium, {}).items()}

    def match_len(self, token_ids: Sequence[int], medium: str = MEDIUM_GPU) -> int:
        """Tokens of the longest prefix of `token_ids` whose full pages are all held in
        `medium` (0 before the first store tells the block size)."""
        return self.match_len_across(token_ids, (medium,))

    def match_len_across(
        self, token_ids: Sequence[int], media: Sequence[str] = (MEDIUM_GPU, MEDIUM_CPU_PINNED)
    ) -> int:
        """Tokens of the longest prefix of `token_ids` made of a run of pages held in
        `media[0]`, then a run held in `media[1]`, and so on (a page held in an earlier
        medium counts there; the walk never goes back to one). With the default, the
        device hits then the host hits of a worker with a host tier."""
        bs = self.block_size
        if bs <= 0 or not media:
            return 0
        tiers = [self.pages.get(m, {}) for m in media]
        tier, prior, n = 0, None, 0
        for i in range(0, len(token_ids) - len(token_ids) % bs, bs):
            prior = page_digest(prior, token_bytes(token_ids[i : i + bs]))
            h = digest_to_int64(prior)
            while tier < len(tiers) and h not in tiers[tier]:
                tier += 1
            if tier == len(tiers):
                break
            n += bs
        return n
