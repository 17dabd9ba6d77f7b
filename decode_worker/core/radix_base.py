"""Shared state and walking of the unified radix tree (split from `radix_tree` by
responsibility): construction, page keys, the downward walk, LRU touches and node splits.

See `radix_tree.UnifiedRadixTree` for the public contract.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

from decode_worker.core.host_tier import HostTierStats, HostTransition, HostWrite, WritePolicy
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_events import KVEventRecorder
from decode_worker.core.radix_lru import RadixLedger
from decode_worker.core.radix_node import Node, PageKey, common_pages, page_keys
from decode_worker.errors import ConfigError
from decode_worker.utils.mathx import cdiv

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T", bound="TreeBase")


def changes_tree(method: Callable[Concatenate[T, P], R]) -> Callable[Concatenate[T, P], R]:
    """Marks a tree method that changes what a match or an admission budget sees (insert,
    evict, lock, unlock): each call bumps `version` first. The one place it is bumped."""

    def bumped(self: T, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.version += 1
        return method(self, *args, **kwargs)

    functools.update_wrapper(bumped, method)
    return bumped


class TreeBase:
    """State every part of the tree shares; not used on its own."""

    def __init__(
        self,
        page_size: int,
        window: int,
        full: PageAllocator,
        swa: PageAllocator | None,
        *,
        kv_events: bool = False,
        host: PageAllocator | None = None,
        write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    ) -> None:
        """`window` in tokens (HF `sliding_window - 1`). `swa=None` for a model without SWA
        layers: every node is then SWA-less and RESUME matches need full KV only. `host`: the
        host tier's page allocator (full-attention KV only), None for no host tier.
        `kv_events`: record KV events of the full-attention pages (`take_events`)."""
        if page_size < 1 or window < 0:
            raise ConfigError(f"radix tree: page_size {page_size} / window {window} invalid")
        self.page_size = page_size
        self.window = window
        self.full = full
        self.swa = swa
        self.root = Node(None, [], [], None)
        self.root.full_lock = 1  # never evicted, never counted
        self.ledger = RadixLedger()
        self.events = KVEventRecorder(page_size, enabled=kv_events)
        self.host = host
        self.write_policy = write_policy  # a property: keeps `_hit_threshold` in step
        self.host_stats = HostTierStats()
        # device -> host copies the shell has not made yet (see `core/host_tier.py`), or, when
        # the shell sets `write_sink`, none: each copy is handed to it the moment it is decided
        self.host_writes: list[HostWrite] = []
        self.write_sink: Callable[[HostWrite], None] | None = None
        # called on every host-tier transition (write, demote, promote, host eviction)
        self.host_listener: Callable[[HostTransition], None] | None = None
        self._tick = 0
        self._uuid = 0
        # bumped by every change a match or an admission budget can see (`changes_tree`); not
        # by a match (its splits and LRU touches change no answer). A caller that saw the same
        # version sees the same matches and the same evictable/protected counts.
        self.version = 0
        # pages of one page-aligned window: the leaf size when insert caps a long live run
        self._window_pages = max(1, cdiv(window, page_size))

    @property
    def write_policy(self) -> WritePolicy:
        return self._write_policy

    @write_policy.setter
    def write_policy(self, policy: WritePolicy) -> None:
        self._write_policy = policy
        self._hit_threshold = policy.hit_threshold  # read on every match and insert

    def _keys(self, token_ids: Sequence[int], keys: Sequence[PageKey] | None) -> list[PageKey]:
        if keys is None:
            return page_keys(token_ids, self.page_size)
        return keys if isinstance(keys, list) else list(keys)

    def _walk(self, keys: list[PageKey], limit: int) -> list[Node]:
        """Nodes matching `keys[:limit]` from the root down; the last one is split so that it
        ends exactly at the match end."""
        node, i, path = self.root, 0, []
        while i < limit:
            child = node.children.get(keys[i])
            if child is None:
                break
            ck = child.key
            end = i + len(ck)
            if end <= limit and (end == i + 1 or ck == keys[i:end]):  # whole node (fast path)
                path.append(child)
                node, i = child, end
                continue
            path.append(self._split(child, common_pages(ck, keys, i, limit)))
            break
        return path

    def _resume_depth(self, path: list[Node]) -> int:
        """How many nodes of `path` a RESUME match may use: the deepest node end with live SWA
        for the `window` tokens before it (or live all the way from position 0)."""
        if self.window == 0:
            return len(path)
        best, run, clean = 0, 0, True
        for depth, node in enumerate(path, 1):
            if node.swa is None:
                run, clean = 0, False
                continue
            run += len(node.key) * self.page_size
            if clean or run >= self.window:
                best = depth
        return best

    def _touch(self, path: list[Node]) -> None:
        """Mark `path` used now: full LRU on every node, SWA LRU on about one window (from the
        last device node). With a host tier the path may end in host-only nodes: the last
        device node and the last node are requeued in their leaf orders."""
        tick = self._tick
        for node in path:
            node.tick = tick
        if not path:
            return
        last: Node | None = path[-1]
        ledger = self.ledger
        if last is not None and last.full is None:
            if last in ledger.host_leaves.nodes:
                ledger.host_leaves.add(last)
            last = self._last_device(path)
        if last is None:
            return
        if last in ledger.leaves:
            ledger.add_leaf(last)
        self._swa_refresh(last)

    @staticmethod
    def _last_device(path: list[Node]) -> Node | None:
        """The deepest node of `path` on the device (device nodes come first on a path)."""
        for node in reversed(path):
            if node.full is not None:
                return node
        return None

    def _has_host_only(self) -> bool:
        """Some node of the tree is host-only (O(1): from the ledger's host page counts, which
        count exactly the host-only nodes' pages)."""
        ledger = self.ledger
        return bool(ledger.host_evictable or ledger.host_protected)

    def _has_device_child(self, node: Node) -> bool:
        """Some child of `node` is on the device (without a host-only node anywhere: any
        child). Called on every node an unlock walks: the O(1) case keeps an unused host
        tier free (`scripts/bench_radix.py --compare-host-tier`)."""
        if self.host is None or not self._has_host_only():
            return bool(node.children)
        return any(c.full is not None for c in node.children.values())

    def _swa_refresh(self, node: Node) -> None:
        """Window-bounded SWA LRU refresh: live values within `window + page_size` tokens above
        `node`'s end become the most recent (the deepest last)."""
        if self.swa is None:
            return
        span = self.window + self.page_size
        got, live = 0, []
        while node is not self.root and got < span:
            if node.swa is not None:
                live.append(node)
            got += len(node.key) * self.page_size
            node = node.parent  # type: ignore[assignment]
        live.reverse()
        self.ledger.swa_touch(live)

    def _split(self, node: Node, m: int) -> Node:
        """Split `node` after `m` pages (0 < m < len); returns the new upper node. `node` keeps
        its identity (and children) as the lower part. Locks and epochs are inherited; the SWA
        boundary mark moves to the upper node. No counter changes."""
        parent = node.parent
        assert parent is not None  # the root is never split (its key is empty)
        full = node.full
        upper = Node(parent, node.key[:m], None if full is None else full[:m], None, node.tick)
        upper.full_lock, upper.swa_lock, upper.hits = node.full_lock, node.swa_lock, node.hits
        if node.host is not None:
            upper.host, node.host = node.host[:m], node.host[m:]
        upper.swa_epoch, upper.swa_uuid = node.swa_epoch, node.swa_uuid
        upper.run, upper.run_at = node.run, node.run_at  # a split emits nothing: pages
        node.run_at += m  # keep their identity
        node.swa_uuid = 0
        if node.swa is not None:
            upper.swa = node.swa[:m]
            node.swa = node.swa[m:]
            self.ledger.swa_add(upper)
        node.key = node.key[m:]
        node.full = None if full is None else full[m:]
        parent.children[upper.key[0]] = upper
        upper.children[node.key[0]] = node
        node.parent = upper
        return upper
