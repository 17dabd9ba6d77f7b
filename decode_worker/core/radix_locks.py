"""Locks of the unified radix tree: the handle a request keeps while it uses a prefix
(`LockRef`), and the lock-ref arithmetic (full lock to the root, SWA lock over one window)."""

from __future__ import annotations

from dataclasses import dataclass

from decode_worker.core.radix_base import TreeBase, changes_tree
from decode_worker.core.radix_node import Node
from decode_worker.errors import LockStateError


@dataclass(slots=True, eq=False)
class LockRef:
    """A request's lock on the path root -> `node`.

    - `full_held`: the full lock is held on every node from `node` up to the root.
    - `swa_held`: the SWA lock is held on the live nodes from `node` up to the node marked
      `swa_uuid` (about one window), or up to the root when `swa_uuid == 0`.
    - `epoch`: the tree tick when the lock was taken; SWA values made live later (healed
      tombstones) were not counted by this lock and are skipped on release.
    Released by `UnifiedRadixTree.unlock`; `release_swa_lock` drops only the SWA part early.
    """

    node: Node
    epoch: int
    swa_uuid: int = 0
    full_held: bool = True
    swa_held: bool = False

    @property
    def is_held(self) -> bool:
        """True until `unlock`."""
        return self.full_held


class LockOps(TreeBase):
    """`lock`, `unlock`, `release_swa_lock` (mixed into `UnifiedRadixTree`)."""

    @changes_tree
    def lock(self, node: Node, *, swa: bool = True) -> LockRef:
        """Lock the full values on the path root -> `node` and (if `swa`) the live SWA values of
        about one window above `node`'s end: walking up, live values are locked until `window`
        tokens are covered; that node is marked as the span's boundary. Tombstones are skipped.
        Locked pages are never evicted; a locked host-only node is never host-evicted (a lock on
        a match's `host_node` keeps its host hits). Raises `LockStateError` if `node` was
        evicted since its match."""
        if node.parent is None and node is not self.root:
            raise LockStateError(f"lock of an evicted node {node!r} (lock right after the match)")
        self._tick += 1
        ledger, root = self.ledger, self.root
        n = node
        while n is not root:
            if n.full_lock == 0:
                if n.full is not None:
                    ledger.full_evictable -= len(n.key)
                    ledger.full_protected += len(n.key)
                    ledger.discard_leaf(n)
                else:
                    ledger.host_evictable -= len(n.key)
                    ledger.host_protected += len(n.key)
                    ledger.host_leaves.discard(n)
            n.full_lock += 1
            n = n.parent  # type: ignore[assignment]
        ref = LockRef(node, self._tick)
        if swa and self.swa is not None:
            ref.swa_uuid = self._lock_swa(node)
            ref.swa_held = True
        return ref

    def _lock_swa(self, node: Node) -> int:
        """SWA part of `lock`; returns the boundary uuid (0: the walk reached the root)."""
        ledger, root, got = self.ledger, self.root, 0
        while node is not root:
            if node.swa is not None:
                if node.swa_lock == 0:
                    ledger.swa_evictable -= len(node.key)
                    ledger.swa_protected += len(node.key)
                node.swa_lock += 1
                got += len(node.key) * self.page_size
                if got >= self.window:
                    if not node.swa_uuid:
                        self._uuid += 1
                        node.swa_uuid = self._uuid
                    return node.swa_uuid
            node = node.parent  # type: ignore[assignment]
        return 0

    @changes_tree
    def unlock(self, lock: LockRef, *, skip_swa: bool = False) -> None:
        """Release `lock`. The SWA part is released iff still held: after `release_swa_lock` it is
        skipped, so nothing is released twice; `skip_swa` is accepted for symmetry with SGLang and
        never leaves an SWA count behind. Raises `LockStateError` on a lock already released."""
        if not lock.full_held:
            raise LockStateError("unlock of a tree lock that is already released")
        if lock.swa_held:
            self.release_swa_lock(lock)
        lock.full_held = False
        ledger, root = self.ledger, self.root
        # no host-only node anywhere (kept so by this walk: it only moves host pages between
        # protected and evictable): every child is on the device, checked in O(1) per node
        host_only = self.host is not None and self._has_host_only()
        n = lock.node
        while n is not root:
            if n.full_lock <= 0:
                raise LockStateError(f"full lock underflow at {n!r}")
            n.full_lock -= 1
            if n.full_lock == 0:
                if n.full is None:
                    ledger.host_protected -= len(n.key)
                    ledger.host_evictable += len(n.key)
                    if not n.children:
                        ledger.host_leaves.add(n)
                else:
                    ledger.full_protected -= len(n.key)
                    ledger.full_evictable += len(n.key)
                    if not n.children or (host_only and not self._has_device_child(n)):
                        ledger.add_leaf(n)
            n = n.parent  # type: ignore[assignment]

    def release_swa_lock(self, lock: LockRef) -> None:
        """Release only the SWA part of `lock` (a request decoding past its window); a no-op if
        already released. Walks the same span as `lock`: live values made live before the lock,
        up to the node marked with the lock's uuid."""
        if lock.swa_held:
            self._release_swa(lock)

    @changes_tree
    def _release_swa(self, lock: LockRef) -> None:
        lock.swa_held = False
        ledger, root, n = self.ledger, self.root, lock.node
        while n is not root:
            if n.swa is not None and n.swa_epoch < lock.epoch:
                if n.swa_lock <= 0:
                    raise LockStateError(f"SWA lock underflow at {n!r}")
                n.swa_lock -= 1
                if n.swa_lock == 0:
                    ledger.swa_protected -= len(n.key)
                    ledger.swa_evictable += len(n.key)
            if lock.swa_uuid and n.swa_uuid == lock.swa_uuid:
                return
            n = n.parent  # type: ignore[assignment]
