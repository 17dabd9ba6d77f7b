"""Lock references of the unified radix tree (the handle a request keeps while it uses a prefix).

The lock arithmetic itself lives in `radix_tree.UnifiedRadixTree.lock/unlock`; this module holds
the handle so that `req_kv` can name it without importing the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from decode_worker.core.radix_node import Node


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
