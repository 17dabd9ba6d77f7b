"""Property test: random traffic, locks, matches, evictions (device pool small) and flushes on a
tree that records KV events; after every step an index rebuilt from the events alone holds
exactly the tree's full-attention pages, predicts every TRANSFER match, and equals the index a
fresh snapshot gives."""

from __future__ import annotations

from hypothesis.stateful import invariant, rule

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.radix_events import MEDIUM_GPU, digest_to_int64, key_tokens
from decode_worker.core.radix_node import Node
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from tests.unit.core.radix_machine import BASES, machine_settings
from tests.unit.core.test_radix_stateful import RadixMachine


def tree_entries(
    tree: UnifiedRadixTree, medium: str = MEDIUM_GPU
) -> set[tuple[int, int | None, tuple[int, ...]]]:
    """(hash, parent hash, tokens) of every page the tree holds in `medium` (device pages for
    `GPU`, host copies for `CPU_PINNED`)."""
    out: set[tuple[int, int | None, tuple[int, ...]]] = set()
    stack: list[Node] = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        assert node.parent is not None
        stack.extend(node.children.values())
        if (node.full if medium == MEDIUM_GPU else node.host) is None:
            continue
        prior = node.parent.hashes[-1] if node.parent.hashes else None
        parent = digest_to_int64(prior) if prior is not None else None
        tokens = key_tokens(node.key, tree.page_size)
        ps = tree.page_size
        for i, digest in enumerate(node.hashes):
            h = digest_to_int64(digest)
            out.add((h, parent, tuple(tokens[i * ps : (i + 1) * ps])))
            parent = h
    return out


class EventMachine(RadixMachine):
    KV_EVENTS = True

    @rule()
    def flush(self) -> None:
        full, swa = self.tree.flush()
        self._forget(full, swa=False)
        self._forget(swa, swa=True)

    @invariant()
    def events_agree_with_the_tree(self) -> None:
        if not hasattr(self, "tree"):
            return
        if not hasattr(self, "index"):
            self.index = KVEventIndex()
        self.index.apply(self.tree.take_events())
        index = self.index
        assert index.entries() == tree_entries(self.tree)
        assert (index.orphan_stores, index.duplicate_stores, index.unknown_removals) == (0, 0, 0)
        snap = KVEventIndex()
        snap.apply(self.tree.snapshot_events())
        assert snap.entries() == index.entries()
        for base in BASES:
            for toks in (base, base[:13], [*base[:6], 1, 2]):
                want = self._expected(toks, MatchMode.TRANSFER, len(toks))
                assert index.match_len(toks) == want


EventMachine.TestCase.settings = machine_settings(150)
TestEventMachine = EventMachine.TestCase
