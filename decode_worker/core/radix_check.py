"""`check_integrity()` of the unified radix tree: every invariant, O(tree size).

Checked (any failure raises `FatalError` naming the invariant):
- links: the root has no parent, an empty key and `full_lock == 1`; each child is filed under its
  first page key and points back at its parent; key, full and SWA values have equal page counts
  while the tree records KV events, each node names its pages in a `PageRun` (the same keys)
  chained from its parent's last page, so their hashes are the chain of the node's path;
- locks: `full_lock >= swa_lock >= 0`; tombstones have `swa_lock == 0` and no boundary mark;
- pages: tree pages are unique, in range and allocated; held pages are allocated and not in the
  tree; per pool `total == available + evictable + protected + held` with the tree's counters
  equal to the sums over nodes;
- eviction orders: the leaf set is exactly the unlocked non-root device nodes without a device
  child, each with a current heap entry; the SWA LRU holds exactly the live SWA values;
- host tier: every node is on the device, on the host or both; a host-only node is an SWA
  tombstone; a device child has a device parent and a host child a host parent; host pages are
  unique, allocated and account for every used host page (`total == available + tree`); the
  host counters equal the sums over host-only nodes; the host leaf set is exactly the unlocked
  childless host-only nodes, each with a current heap entry.

Deliberately not an invariant here: SGLang's "no all-tombstone leaf". TRANSFER matches reuse the
full KV of tombstoned leaves (the SWA tail always arrives fresh), and RESUME matches check the
live window themselves, so a tombstoned leaf is useful and never mistaken for a resumable one.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from decode_worker.core.page_chain import page_before
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_node import Node
from decode_worker.errors import FatalError

if TYPE_CHECKING:
    from decode_worker.core.radix_base import TreeBase


def check_tree(tree: TreeBase, held_full: Collection[int], held_swa: Collection[int]) -> None:
    """Raise `FatalError` unless every invariant in the module docstring holds."""
    tree.full.check_integrity()
    if tree.swa is not None:
        tree.swa.check_integrity()
    nodes = _nodes(tree.root)
    for node in nodes:
        _check_node(node, hashed=tree.events.enabled)
    led = tree.ledger
    full_ev, full_pr, full_pages = _sums(nodes, swa=False)
    _check_pool(tree.full, full_pages, held_full, full_ev, full_pr)
    if (full_ev, full_pr) != (led.full_evictable, led.full_protected):
        raise FatalError(
            f"full counters {led.full_evictable}/{led.full_protected} != tree sums "
            f"{full_ev}/{full_pr}"
        )
    swa_ev, swa_pr, swa_pages = _sums(nodes, swa=True)
    if tree.swa is not None:
        _check_pool(tree.swa, swa_pages, held_swa, swa_ev, swa_pr)
    elif swa_pages or held_swa:
        raise FatalError("SWA pages in a tree without an SWA pool")
    if (swa_ev, swa_pr) != (led.swa_evictable, led.swa_protected):
        raise FatalError(
            f"SWA counters {led.swa_evictable}/{led.swa_protected} != tree sums {swa_ev}/{swa_pr}"
        )
    _check_orders(tree, nodes)
    _check_host(tree, nodes)


def _nodes(root: Node) -> list[Node]:
    """All nodes but the root, checking the root and the parent/child links on the way."""
    if root.parent is not None or root.key or root.full or root.full_lock != 1:
        raise FatalError("root: must have no parent, an empty key and full_lock 1")
    out: list[Node] = []
    stack = [root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            if child.parent is not node or not child.key or child.key[0] != first:
                raise FatalError(f"link: {child!r} misfiled under its parent")
            out.append(child)
            stack.append(child)
    return out


def _check_node(node: Node, *, hashed: bool) -> None:
    k = len(node.key)
    full, host, parent = node.full, node.host, node.parent
    if full is None and host is None:
        raise FatalError(f"tiers: {node!r} is neither on the device nor on the host")
    if (full is not None and len(full) != k) or (host is not None and len(host) != k):
        raise FatalError(f"values: {node!r} key and full value lengths differ")
    if node.swa is not None and (len(node.swa) != k or full is None):
        raise FatalError(f"values: {node!r} SWA length differs, or live SWA on a host-only node")
    assert parent is not None
    if parent.parent is not None and (
        (full is not None and parent.full is None) or (host is not None and parent.host is None)
    ):
        raise FatalError(f"tiers: {node!r} is on a tier its parent is not on")
    _check_pages(node, parent, hashed=hashed)
    if node.swa_lock < 0 or node.full_lock < node.swa_lock:
        raise FatalError(f"locks: {node!r} needs full_lock >= swa_lock >= 0")
    if node.swa is None and (node.swa_lock or node.swa_uuid):
        raise FatalError(f"tombstone: {node!r} is locked or marked")


def _check_pages(node: Node, parent: Node, *, hashed: bool) -> None:
    """KV events on: the node names its pages in a run (the same keys), chained from its
    parent's last page, so their hashes are the chain of the node's path. Off: no run."""
    run, at, k = node.run, node.run_at, len(node.key)
    if run is None or not hashed:
        if run is not None or hashed:
            raise FatalError(f"hashes: {node!r} names {'no' if hashed else 'its'} pages")
        return
    if at < 0 or run.keys[at : at + k] != node.key:
        raise FatalError(f"hashes: {node!r} names pages of other keys")
    before, tail = page_before(run, at), parent.tail_page()
    if (before is None) != (tail is None) or (
            before is not None and tail is not None
            and (before[0] is not tail[0] or before[1] != tail[1])):
        raise FatalError(f"hashes: {node!r} does not chain from its parent's last page")


def _sums(nodes: list[Node], *, swa: bool) -> tuple[int, int, list[int]]:
    """(evictable pages, protected pages, all page ids) of one pool over `nodes`."""
    evictable = protected = 0
    pages: list[int] = []
    for node in nodes:
        value = node.swa if swa else node.full
        if value is None:
            continue
        pages += value
        if (node.swa_lock if swa else node.full_lock) > 0:
            protected += len(value)
        else:
            evictable += len(value)
    return evictable, protected, pages


def _check_pool(
    pool: PageAllocator, tree_pages: list[int], held: Collection[int], ev: int, pr: int
) -> None:
    name = pool.name
    tree_set, held_set = set(tree_pages), set(held)
    if len(tree_set) != len(tree_pages):
        raise FatalError(f"pool {name!r}: a page is referenced twice by the tree")
    if len(held_set) != len(held):
        raise FatalError(f"pool {name!r}: a held page is listed twice")
    if tree_set & held_set:
        raise FatalError(f"pool {name!r}: a page is both held and in the tree")
    if not pool.all_held(tree_set) or not pool.all_held(held_set):
        raise FatalError(f"pool {name!r}: a referenced page is free or out of range")
    if pool.num_total != pool.num_free + ev + pr + len(held_set):
        raise FatalError(
            f"pool {name!r}: total {pool.num_total} != available {pool.num_free} + evictable {ev}"
            f" + protected {pr} + held {len(held_set)}"
        )


def _check_orders(tree: TreeBase, nodes: list[Node]) -> None:
    led = tree.ledger
    leaves = {
        n for n in nodes
        if n.full is not None and n.full_lock == 0
        and not any(c.full is not None for c in n.children.values())
    }
    if leaves != led.leaves:
        raise FatalError("leaves: the evictable-leaf set is not the unlocked device leaves")
    queued = {(id(n), t) for t, _, n in led.heap}
    if any((id(n), n.tick) not in queued for n in leaves):
        raise FatalError("leaves: an evictable leaf has no current heap entry")
    live = [n for n in nodes if n.swa is not None]
    if len(led.swa_lru) != len(live) or any(n not in led.swa_lru for n in live):
        raise FatalError("swa lru: not exactly the nodes with a live SWA value")


def _check_host(tree: TreeBase, nodes: list[Node]) -> None:
    led, host = tree.ledger, tree.host
    pages = [p for n in nodes if n.host is not None for p in n.host]
    if host is None:
        if pages or any(n.full is None for n in nodes):
            raise FatalError("host: host values in a tree without a host tier")
        return
    host.check_integrity()
    if len(set(pages)) != len(pages) or not host.all_held(pages):
        raise FatalError("host: a host page is shared, free or out of range")
    if host.num_total != host.num_free + len(pages):
        raise FatalError(
            f"host: total {host.num_total} != available {host.num_free} + tree {len(pages)}"
        )
    ev, pr = _host_sums(nodes)
    if (ev, pr) != (led.host_evictable, led.host_protected):
        raise FatalError(
            f"host counters {led.host_evictable}/{led.host_protected} != tree sums {ev}/{pr}"
        )
    leaves = {n for n in nodes if n.full is None and not n.children and n.full_lock == 0}
    if leaves != led.host_leaves.nodes:
        raise FatalError("host leaves: not exactly the unlocked childless host-only nodes")
    queued = {(id(n), t) for t, _, n in led.host_leaves.heap}
    if any((id(n), n.tick) not in queued for n in leaves):
        raise FatalError("host leaves: a host leaf has no current heap entry")


def _host_sums(nodes: list[Node]) -> tuple[int, int]:
    """(evictable, protected) host pages of host-only nodes."""
    ev = sum(len(n.key) for n in nodes if n.full is None and n.full_lock == 0)
    pr = sum(len(n.key) for n in nodes if n.full is None and n.full_lock > 0)
    return ev, pr
