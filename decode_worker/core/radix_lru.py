"""Per-pool bookkeeping of the unified radix tree: evictable/protected page counters, the full
pool's evictable-leaf set with a lazy LRU heap, the SWA pool's LRU of live SWA values, and the
host tier's evictable host-only leaves (a second lazy LRU heap).

No clocks: recency is the tree's logical tick stored in `Node.tick`.
"""

from __future__ import annotations

import heapq
from itertools import count

from decode_worker.core.radix_node import Node


class RadixLedger:
    """Counters and eviction orders; the tree calls these on every state change.

    Invariants (checked by `radix_check`):
    - `full_evictable` / `full_protected`: pages of nodes with `full_lock == 0` / `> 0`;
    - `swa_evictable` / `swa_protected`: pages of live SWA values with `swa_lock == 0` / `> 0`;
    - `leaves`: exactly the non-root nodes without children and with `full_lock == 0`; each has a
      heap entry `(node.tick, _, node)` (stale entries are skipped on pop);
    - `swa_lru`: exactly the nodes with a live SWA value, least recently used first.
    - `host_evictable` / `host_protected`: host pages of host-only nodes with `full_lock == 0`
      (all of them can be host-evicted, leaf by leaf) / `> 0`; `host_leaves`: exactly the
      host-only childless nodes with `full_lock == 0`, each with a current heap entry.
    With a host tier, "childless" for `leaves` means "no child on the device" (a device leaf may
    keep host-only children).
    """

    def __init__(self) -> None:
        self.full_evictable = 0
        self.full_protected = 0
        self.swa_evictable = 0
        self.swa_protected = 0
        self.host_evictable = 0
        self.host_protected = 0
        self.host_leaves = LeafLru()
        self.leaves: set[Node] = set()
        self.heap: list[tuple[int, int, Node]] = []
        self.swa_lru: dict[Node, None] = {}  # insertion-ordered: first = least recent
        self._seq = count()

    # -- full pool: evictable leaves ---------------------------------------------------------
    def add_leaf(self, node: Node) -> None:
        """`node` became an evictable leaf (or was touched while one): (re)queue it."""
        self.leaves.add(node)
        heapq.heappush(self.heap, (node.tick, next(self._seq), node))
        if len(self.heap) > 2 * len(self.leaves) + 64:
            self._compact()

    def discard_leaf(self, node: Node) -> None:
        """`node` is no longer an evictable leaf (locked, or got a child)."""
        self.leaves.discard(node)

    def pop_lru_leaf(self) -> Node | None:
        """Remove and return the least recently used evictable leaf, or None."""
        heap = self.heap
        leaves = self.leaves
        while heap:
            tick, _, node = heapq.heappop(heap)
            if node in leaves and node.tick == tick:
                leaves.discard(node)
                return node
        return None

    def _compact(self) -> None:
        self.heap = [(n.tick, next(self._seq), n) for n in self.leaves]
        heapq.heapify(self.heap)

    # -- SWA pool: LRU of live values ----------------------------------------------------------
    def swa_add(self, node: Node) -> None:
        """`node` got a live SWA value: most recently used."""
        self.swa_lru[node] = None

    def swa_remove(self, node: Node) -> None:
        """`node`'s SWA value is gone (tombstoned or node deleted)."""
        del self.swa_lru[node]

    def swa_touch(self, nodes: list[Node]) -> None:
        """Move `nodes` (live) to most recently used, in order (the last is the newest)."""
        lru = self.swa_lru
        for node in nodes:
            del lru[node]
            lru[node] = None

    def swa_victims(self, num_pages: int) -> list[Node]:
        """Least recently used unlocked live SWA values covering at least `num_pages` pages
        (fewer if not enough); nothing is changed."""
        victims: list[Node] = []
        got = 0
        for node in self.swa_lru:
            if got >= num_pages:
                break
            if node.swa_lock == 0:
                victims.append(node)
                got += len(node.key)
        return victims


class LeafLru:
    """A set of leaves with a lazy min-heap on `Node.tick` (stale entries skipped on pop)."""

    def __init__(self) -> None:
        self.nodes: set[Node] = set()
        self.heap: list[tuple[int, int, Node]] = []
        self._seq = count()

    def add(self, node: Node) -> None:
        """`node` is (again) a leaf here, with its current tick."""
        self.nodes.add(node)
        heapq.heappush(self.heap, (node.tick, next(self._seq), node))
        if len(self.heap) > 2 * len(self.nodes) + 64:
            self.heap = [(n.tick, next(self._seq), n) for n in self.nodes]
            heapq.heapify(self.heap)

    def discard(self, node: Node) -> None:
        self.nodes.discard(node)

    def pop(self) -> Node | None:
        """Remove and return the least recently used leaf, or None."""
        heap, nodes = self.heap, self.nodes
        while heap:
            tick, _, node = heapq.heappop(heap)
            if node in nodes and node.tick == tick:
                nodes.discard(node)
                return node
        return None
