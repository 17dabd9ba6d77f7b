"""The host tier's vocabulary (pure data): write policies, the copies the tree asks the shell
to make, the transitions it reports, and its counters.

The tree decides, the shell copies: a `HostWrite` (device -> host) is queued by the tree the
moment it gives a node a host copy; the shell must drain `take_host_writes()` before any device
page is written again (before posting transfers and before running a step), because the
device pages may already be free. A `HostRestore` (host -> device) is part of an admission: the
request holds a lock on the host pages and owns the device pages until it starts running.
Semantics follow SGLang's HiCache (`--hicache-write-policy`): `write_through` backs a node up on
its insert (or first hit), `write_through_selective` once it is hit again, `write_back` only when
device eviction would otherwise lose it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.core.radix_node import Node


class WritePolicy(enum.Enum):
    """When a node's full KV is copied device -> host (SGLang's names and meaning)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"

    @property
    def hit_threshold(self) -> int | None:
        """Hits (insert counts as the first) after which a node is backed up; None: only at
        device eviction."""
        return {"write_through": 1, "write_through_selective": 2}.get(self.value)


class Transition(enum.Enum):
    """A change of where a node's full KV lives (reported to `UnifiedRadixTree.host_listener`).

    - WRITE: a host copy was stored (device -> host queued); the device copy stays.
    - DEMOTE: the device copy was dropped by device eviction; the node stays, host-only.
    - PROMOTE: a host-only node got device pages again (restored KV inserted, or the same
      tokens transferred by another request); the host copy stays.
    - HOST_EVICT: a host-only leaf was dropped from the host tier (node deleted).
    """

    WRITE = "write"
    DEMOTE = "demote"
    PROMOTE = "promote"
    HOST_EVICT = "host_evict"


@dataclass(frozen=True, slots=True)
class HostTransition:
    """One transition of `node` (still linked, except after HOST_EVICT). `device_page_ids` /
    `host_page_ids`: the pages stored in or removed from each medium by this transition
    (the other medium's pages where it does not change, for context)."""

    kind: Transition
    node: Node
    device_page_ids: list[int]
    host_page_ids: list[int]


@dataclass(frozen=True, slots=True)
class HostWrite:
    """Copy the full KV of `device_page_ids[i]` to `host_page_ids[i]` (same length)."""

    device_page_ids: list[int]
    host_page_ids: list[int]


@dataclass(frozen=True, slots=True)
class HostRestore:
    """Copy host pages to a request's fresh device pages (same length), before it runs."""

    host_page_ids: list[int]
    device_page_ids: list[int]

    @property
    def num_pages(self) -> int:
        return len(self.host_page_ids)


@dataclass(slots=True)
class HostTierStats:
    """Counters of the host tier (pages; the shell turns them into metrics)."""

    written_pages_total: int = 0
    write_failures_total: int = 0  # a backup skipped: the host pool stayed full
    demoted_pages_total: int = 0
    promoted_pages_total: int = 0
    host_evicted_pages_total: int = 0
    by_transition: dict[str, int] = field(default_factory=dict)
