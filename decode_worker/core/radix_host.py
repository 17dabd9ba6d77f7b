"""The host tier of the unified radix tree: host copies (writes), promotion of host-only nodes,
hit counting for the write policies, and the transition report (see `core/host_tier.py`).

Every host-tier transition goes through `_emit`, the one place a listener (KV events, metrics)
sees them; device eviction with demotion and host eviction are in `radix_evict.py`.
"""

from __future__ import annotations

from decode_worker.core.host_tier import HostTransition, HostWrite, Transition
from decode_worker.core.radix_base import TreeBase, changes_tree
from decode_worker.core.radix_events import MEDIUM_CPU_PINNED, MEDIUM_GPU
from decode_worker.core.radix_node import Node


class HostOps(TreeBase):
    """Host-tier helpers mixed into `UnifiedRadixTree`."""

    def take_host_writes(self) -> list[HostWrite]:
        """The device -> host copies queued since the last call (the caller makes them before
        any device page is written again; see `core/host_tier.py`)."""
        out, self.host_writes = self.host_writes, []
        return out

    def _emit(self, kind: Transition, node: Node, device: list[int], host: list[int]) -> None:
        """Report one transition: its KV events (a store in or a removal from one medium; the
        device removal of a demotion is recorded by `evict_full` with the others), then the
        listener."""
        events = self.events
        if events.enabled:
            at, end = node.run_at, node.run_at + len(node.key)
            if kind is Transition.WRITE or kind is Transition.PROMOTE:
                medium = MEDIUM_CPU_PINNED if kind is Transition.WRITE else MEDIUM_GPU
                events.stored(node.run, at, end, medium)
            elif kind is Transition.HOST_EVICT:
                events.removed(node.run, at, end, MEDIUM_CPU_PINNED)
        listener = self.host_listener
        if listener is not None:
            listener(HostTransition(kind, node, device, host))

    def _count_hits(self, path: list[Node]) -> None:
        """A match used the device nodes of `path`: count a hit on each and back up the deepest
        one that reached the policy's threshold (with its ancestors)."""
        threshold = self._hit_threshold
        if self.host is None or threshold is None:
            return
        due: Node | None = None
        for node in path:
            if node.full is None:
                break
            node.hits += 1
            if node.host is None and node.hits >= threshold:
                due = node
        if due is not None:
            self._write(due)

    def _write_on_insert(self, node: Node) -> None:
        """After an insert ending at `node`: `write_through` backs up the path at once."""
        if (self.host is not None and self._hit_threshold == 1
                and node.host is None and node is not self.root):
            self._write(node)

    def _write(self, node: Node) -> bool:
        """Give `node` and its ancestors without one a host copy, top-down (a host child
        always has a host parent), evicting from the host tier for room. Queues one
        `HostWrite`. False (nothing changed) when the host pool cannot hold the chain."""
        host = self.host
        assert host is not None
        chain: list[Node] = []
        n = node
        while n is not self.root and n.host is None:
            chain.append(n)
            n = n.parent  # type: ignore[assignment]
        need = sum(len(c.key) for c in chain)
        if host.num_free < need:
            self.evict_host(need - host.num_free)
        if host.num_free < need:
            self.host_stats.write_failures_total += 1
            return False
        pages = host.alloc(need)
        dev_ids: list[int] = []
        at = 0
        for c in reversed(chain):  # top-down
            k = len(c.key)
            c.host = pages[at : at + k]
            at += k
            assert c.full is not None  # a node without a host copy is on the device
            dev_ids += c.full
            self._emit(Transition.WRITE, c, c.full, c.host)
        job = HostWrite(dev_ids, pages)
        if self.write_sink is not None:
            self.write_sink(job)  # made before any freed device page can be reused
        else:
            self.host_writes.append(job)
        self.host_stats.written_pages_total += need
        return True

    def _promote(self, node: Node, pages: list[int]) -> None:
        """Host-only `node` gets the device pages `pages` (restored or transferred KV, owned
        by the caller until now); its host copy stays."""
        k = len(node.key)
        ledger = self.ledger
        node.full = pages
        if node.full_lock > 0:
            ledger.full_protected += k
            ledger.host_protected -= k
        else:
            ledger.full_evictable += k
            ledger.host_evictable -= k
            ledger.host_leaves.discard(node)
            if not self._has_device_child(node):
                ledger.add_leaf(node)
        parent = node.parent
        assert parent is not None
        ledger.discard_leaf(parent)  # it has a device child now
        self.host_stats.promoted_pages_total += k
        self._emit(Transition.PROMOTE, node, pages, node.host or [])

    def evict_host(self, num_pages: int) -> list[int]:
        """Drop host-only leaves no request holds, least recently used first, until at least
        `num_pages` host pages are free again or none is left; deletes those nodes (a parent
        left host-only and childless becomes a host leaf). Returns the host page ids freed."""
        if self.host is None or num_pages <= 0:
            return []
        return self._evict_host(num_pages)

    @changes_tree
    def _evict_host(self, num_pages: int) -> list[int]:
        host = self.host
        assert host is not None
        ledger, freed = self.ledger, list[int]()
        while len(freed) < num_pages:
            node = ledger.host_leaves.pop()
            if node is None:
                break
            assert node.host is not None and node.full is None
            freed += node.host
            ledger.host_evictable -= len(node.key)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            if parent.full is None and not parent.children and parent.full_lock == 0:
                ledger.host_leaves.add(parent)
            self._emit(Transition.HOST_EVICT, node, [], node.host)
        host.free(freed)
        self.host_stats.host_evicted_pages_total += len(freed)
        return freed
