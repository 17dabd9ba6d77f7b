"""The host tier's size, decided at start-up beside the device pools: whether it is on, how many
host pages of full-attention KV it holds, and the words the start-up budget line and
`/server_info` use for it (runtime facts: never written back into settings)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from decode_worker.core.memory_budget import plan_host_pages
from decode_worker.settings import CacheSettings


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else physical pages free."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_enabled(c: CacheSettings) -> bool:
    """`cache.hierarchical_cache`, unset = on where the decode radix cache is on (the tier
    lives under the decode radix tree: off without it)."""
    on = c.decode_radix_cache if c.hierarchical_cache is None else c.hierarchical_cache
    return on and c.decode_radix_cache


@dataclass(frozen=True, slots=True)
class HostPlan:
    """`num_pages` host pages of `page_bytes` each (every full-attention layer, K and V, of one
    page), for `page_size`-token pages; `source` says how the size was derived (the key, and a
    cap if one applied); `write_policy` is `cache.hicache_write_policy`."""

    num_pages: int
    page_bytes: int
    page_size: int
    write_policy: str
    source: str

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        """The budget line's host part: pages, GiB, how it was sized, the write policy."""
        return (f"host tier {self.num_pages} pages ({self.num_pages * self.page_size} tokens) "
                f"= {self.source}, {self.write_policy}")

    def info(self) -> dict[str, Any]:
        """The configured side of `/server_info`'s `host_tier` (the live pages come on top)."""
        return {"num_pages": self.num_pages, "max_tokens": self.num_pages * self.page_size,
                "bytes": self.num_bytes, "gib": round(self.num_bytes / 2**30, 3),
                "write_policy": self.write_policy, "size_source": self.source}


def check_host_size(c: CacheSettings) -> None:
    """Raise ConfigError naming `cache.hicache_size_gb` when it is set and does not fit the
    host's available memory (before anything is loaded; `plan_host_tier` checks it again)."""
    if c.hicache_size_gb is not None:
        plan_host_pages(0, 1, c.hicache_ratio, c.hicache_size_gb, available_host_bytes())


def plan_host_tier(c: CacheSettings, page_bytes: int, num_device_pages: int,
                   page_size: int) -> HostPlan:
    """Size the host tier for `num_device_pages` device full pages of `page_bytes` (all full
    layers). Raises ConfigError naming `cache.hicache_size_gb` when an explicit size does not
    fit the available host memory; a derived size is capped (and `source` says so)."""
    pages, source = plan_host_pages(num_device_pages, page_bytes, c.hicache_ratio,
                                    c.hicache_size_gb, available_host_bytes())
    return HostPlan(pages, page_bytes, page_size, c.hicache_write_policy, source)
