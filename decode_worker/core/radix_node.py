"""Node of the unified radix tree and the page-key helper (pure data, no tree logic).

A key is a list of *page keys*: one per page of `page_size` tokens (the page's token ids packed
as bytes, or the bare token when `page_size == 1`). A child is found by its first page key; a
node's key, full value and SWA value always have the same number of pages.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

from decode_worker.errors import FatalError

if TYPE_CHECKING:
    from decode_worker.core.page_chain import PageRef, PageRun

PageKey = Union[bytes, int]  # noqa: UP007 - a runtime alias, kept readable
_TOKEN_BYTES = 4  # page keys pack token ids as int32


def page_keys(token_ids: Sequence[int], page_size: int) -> list[PageKey]:
    """Page keys of the page-aligned prefix of `token_ids` (a trailing partial page is dropped).

    A key is the page's token ids packed as int32 bytes (the bare token when `page_size == 1`):
    exact (no hashing shortcuts), compared with memcmp, and its hash is cached by the bytes
    object, so a walk costs O(pages), not O(tokens) in Python. Token ids must fit in int32
    (`struct.error` otherwise; the API boundary validates them). Compute the keys once per
    request (`ReqKV.keys`) and pass them to `match_prefix`/`insert` via `keys=`.
    """
    if page_size == 1:
        return list(token_ids)
    n = len(token_ids) - len(token_ids) % page_size
    buf = struct.pack(f"{len(token_ids)}i", *token_ids)  # faster than array("i", ...)
    step = page_size * _TOKEN_BYTES
    return [buf[j : j + step] for j in range(0, n * _TOKEN_BYTES, step)]


class Node:
    """One key segment of the tree with a full value (device and/or host) and an SWA value.

    - `full`: full-pool (device) page ids, one per page of `key` (root: empty), or None: the
      node is *host-only* (its full KV lives in the host tier only).
    - `host`: host-pool page ids of the same full KV, or None (no host copy). A node is device
      (`full` only), host (`host` only) or both; one with neither does not exist. A device
      child has a device parent; a host child has a host parent (writes go top-down).
    - `swa`: SWA-pool page ids, or None: a *tombstone* (SWA gone, full stays). SWA is
      device-only: a host-only node is always a tombstone.
    - `full_lock`, `swa_lock`: lock refs; `full_lock >= swa_lock >= 0`; a tombstone has
      `swa_lock == 0`. `full_lock` pins the node's full value wherever it lives (device pages
      are not evicted, a host-only node is not host-evicted).
    - `hits`: insert + match count (the `write_through_selective` threshold).
    - `swa_uuid`: nonzero marks the top of some lock's SWA span (moves up on a split).
    - `swa_epoch`: tick at which `swa` became live (a lock skips nodes made live after it).
    - `tick`: logical last-access time (LRU for full eviction).
    - `hashes`: the SHA-256 page-chain digest of each page of `key` (`radix_events`), or empty
      while the tree records no KV events.
    """

    __slots__ = (
        "children",
        "full",
        "full_lock",
        "hits",
        "host",
        "key",
        "parent",
        "run",
        "run_at",
        "swa",
        "swa_epoch",
        "swa_lock",
        "swa_uuid",
        "tick",
    )

    def __init__(
        self,
        parent: Node | None,
        key: list[PageKey],
        full: list[int] | None,
        swa: list[int] | None,
        tick: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[PageKey, Node] = {}
        self.key = key
        self.full = full
        self.host: list[int] | None = None
        self.hits = 1
        self.swa = swa
        self.full_lock = 0
        self.swa_lock = 0
        self.swa_uuid = 0
        self.swa_epoch = tick
        self.tick = tick
        self.run: PageRun | None = None  # pages [run_at, run_at + len(key)) of it (KV events)
        self.run_at = 0

    @property
    def hashes(self) -> list[bytes]:
        """SGLang page digests of this node's pages ([] while the tree records no KV events);
        computed on first read (see `page_chain`)."""
        run = self.run
        return [] if run is None else run.digests()[self.run_at : self.run_at + len(self.key)]

    def tail_page(self) -> PageRef | None:
        """This node's last page in the hash chain (None for the root or without KV events)."""
        run = self.run
        return None if run is None else (run, self.run_at + len(self.key) - 1)

    @property
    def num_pages(self) -> int:
        """Pages in this node's key (and in each of its values)."""
        return len(self.key)

    @property
    def on_device(self) -> bool:
        """The full value is on the device (device-only or both)."""
        return self.full is not None

    @property
    def is_host_only(self) -> bool:
        """The full value lives in the host tier only."""
        return self.full is None

    def __repr__(self) -> str:
        state = "tomb" if self.swa is None else "live"
        tier = ("dev+host" if self.host is not None else "dev") if self.full is not None else "host"
        return (
            f"Node(pages={len(self.key)}, {tier}, {state}, full_lock={self.full_lock}, "
            f"swa_lock={self.swa_lock}, children={len(self.children)})"
        )


def common_pages(node_key: list[PageKey], keys: list[PageKey], i: int, limit: int) -> int:
    """Pages of `node_key` equal to `keys[i:limit]` from the start (the first is known equal)."""
    k = len(node_key)
    m = min(k, limit - i)
    if node_key[:m] == keys[i : i + m] if m < k else node_key == keys[i : i + k]:
        return m
    j = 1
    while node_key[j] == keys[i + j]:
        j += 1
    return j


def path_values_of(path: list[Node]) -> tuple[list[int], list[int]]:
    """Concatenated full and SWA page ids of `path` (0 for tombstoned pages); every node of
    `path` must be on the device."""
    full: list[int] = []
    swa: list[int] = []
    for node in path:
        if node.full is None:
            raise FatalError(f"path_values: {node!r} is host-only")
        full += node.full
        swa += node.swa if node.swa is not None else [0] * len(node.key)
    return full, swa


def path_values(node: Node) -> tuple[list[int], list[int]]:
    """`path_values_of` of the path root -> `node`."""
    path: list[Node] = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path_values_of(path)
