"""A process's share of one device's memory, and what is left of it for the KV pools.

`cache.memory_fraction` is the share of the card's *total* memory this process may hold
(weights, both pools, CUDA-graph memory and a headroom for activations), as SGLang's
`--mem-fraction-static` is. Processes that share a card each get their own share, so their
fractions must add up to at most 1; nobody's pools depend on what the others left free:
```
fraction * total = held after loading the weights (context included) + graphs + headroom + pools
```
`graphs` and `headroom` are measured by the caller (a probe capture and a probe step), not
guessed. Pure arithmetic: no torch, no device; the device layer measures and acts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from decode_worker.errors import ConfigError

GIB = 2**30
# What a CUDA context (driver, kernels, cuBLAS handles) holds outside torch's allocator: it is
# charged to the process's share, since the allocator's own figures do not see it.
CONTEXT_BYTES = 512 * 2**20


class MemoryBudgetError(ConfigError):
    """The card cannot give this process its share (raised before anything large is
    allocated), or the share leaves nothing for the pools."""


def gib(n: int | float) -> str:
    """Bytes in GiB for log lines and messages (more digits below 0.1 GiB)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB // 10 or n == 0 else f"{n / GIB:.4f} GiB"


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """How one process's share of the card is spent (bytes)."""

    fraction: float
    total_bytes: int
    weights_bytes: int  # held after loading the weights, the context included
    graph_bytes: int  # measured: the CUDA graphs' memory pool
    headroom_bytes: int  # measured: the peak of eager work (a probe prefill and decode step)
    pool_bytes: int  # what the two pools may take

    @property
    def share_bytes(self) -> int:
        return int(self.fraction * self.total_bytes)

    def describe(self) -> str:
        """One line for the start-up log."""
        return (f"memory budget: cache.memory_fraction={self.fraction:g} of {gib(self.total_bytes)}"
                f" = {gib(self.share_bytes)}: weights {gib(self.weights_bytes)}, pools "
                f"{gib(self.pool_bytes)}, graphs {gib(self.graph_bytes)}, headroom "
                f"{gib(self.headroom_bytes)}")


def check_share_free(fraction: float, total_bytes: int, free_bytes: int,
                     held_bytes: int = CONTEXT_BYTES) -> None:
    """Raise MemoryBudgetError unless the card's free memory covers what this process will
    still allocate of its share (`held_bytes`: what it holds already, its context).

    Called at first contact with the device, before the weights are loaded.
    """
    share = int(fraction * total_bytes)
    need = share - held_bytes
    if free_bytes >= need:
        return
    fits = math.floor((free_bytes + held_bytes) / total_bytes * 100) / 100  # rounded down
    others = total_bytes - free_bytes - held_bytes
    fix = (f"set cache.memory_fraction to at most {fits:.2f} (processes sharing a card need "
           "shares that add up to at most 1) or free the device" if fits >= 0.01
           else "free the device")
    raise MemoryBudgetError(
        f"cache.memory_fraction={fraction:g} asks for {gib(share)} of the device's "
        f"{gib(total_bytes)}, but only {gib(free_bytes)} is free (other processes hold "
        f"{gib(max(0, others))}): {fix}")


def plan_budget(fraction: float, total_bytes: int, weights_bytes: int, graph_bytes: int,
                headroom_bytes: int) -> MemoryBudget:
    """The pools' bytes: the share less the weights, the graphs and the headroom.

    Raises MemoryBudgetError when nothing is left, naming every figure and the setting.
    """
    share = int(fraction * total_bytes)
    pools = share - weights_bytes - graph_bytes - headroom_bytes
    budget = MemoryBudget(fraction, total_bytes, weights_bytes, graph_bytes, headroom_bytes,
                          max(0, pools))
    if pools <= 0:
        raise MemoryBudgetError(
            f"KV pools do not fit: cache.memory_fraction={fraction:g} gives {gib(share)}, of "
            f"which the weights hold {gib(weights_bytes)}, CUDA graphs {gib(graph_bytes)} and "
            f"the activation headroom {gib(headroom_bytes)}; raise cache.memory_fraction")
    return budget


def colocated_share(num_processes: int, card_fraction: float = 0.85) -> float:
    """The `cache.memory_fraction` each of `num_processes` programs gets when they share one
    card (the demo, the tests): `card_fraction` of the card split evenly, rounded down."""
    if num_processes < 1:
        raise ValueError("num_processes must be >= 1")
    return int(card_fraction / num_processes * 1000) / 1000


def plan_host_pages(num_device_pages: int, page_bytes: int, ratio: float,
                    size_gb: float | None, available_bytes: int) -> tuple[int, str]:
    """Pages of the host tier and a note for the start-up log.

    `size_gb` (1e9 bytes, `cache.hicache_size_gb`) wins over `ratio` (`cache.hicache_ratio`,
    host pages per device full page). An explicit size past the host's available memory is a
    `ConfigError` naming the key; a derived size is capped at half the available memory, so the
    tier can never take the host's memory from under the process (the cap is in the note)."""
    if page_bytes <= 0:
        raise ConfigError(f"host tier: page bytes {page_bytes} must be positive")
    if size_gb is not None:
        want = int(size_gb * 1e9)
        if want > available_bytes:
            raise ConfigError(
                f"cache.hicache_size_gb = {size_gb:g}: {gib(want)} does not fit the host's "
                f"available memory ({gib(available_bytes)}); lower it or unset it")
        return want // page_bytes, f"{gib(want)} (cache.hicache_size_gb)"
    pages = int(num_device_pages * ratio)
    cap = available_bytes // 2 // page_bytes
    if pages > cap:
        return cap, (f"{gib(cap * page_bytes)} (cache.hicache_ratio {ratio:g} capped at half "
                     f"the available {gib(available_bytes)})")
    return pages, f"{gib(pages * page_bytes)} (cache.hicache_ratio {ratio:g})"
