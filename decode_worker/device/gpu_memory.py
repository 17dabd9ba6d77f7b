"""This process's share of a CUDA device: the start-up check, the measured graph reserve and
activation headroom, and the bytes left for the pools (`core/memory_budget.py` does the sums).

The device is reached through `DeviceMemory`, a small seam: `CudaMemory` asks the CUDA driver
and torch's caching allocator; tests stand a fake card behind it (tests/fakes/fake_memory.py).
What this process holds is read from its own allocator (reserved bytes, plus `CONTEXT_BYTES`
for the context), so processes that start at the same time do not count each other's memory.

Not thread-safe: the thread that builds the runtime only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from decode_worker.core.memory_budget import (
    CONTEXT_BYTES,
    MemoryBudget,
    check_share_free,
    gib,
    plan_budget,
)

log = logging.getLogger(__name__)


class DeviceMemory(Protocol):
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device, every process counted."""
        ...

    def held_bytes(self) -> int:
        """Bytes this process's allocator holds on the device (not its context)."""
        ...

    def peak_held_bytes(self) -> int:
        """The most `held_bytes` has been since `reset_peak`."""
        ...

    def reset_peak(self) -> None: ...

    def release_cached(self) -> None:
        """Return the allocator's unused cached blocks to the device."""
        ...


class CudaMemory:
    """`DeviceMemory` of one CUDA device, through torch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def held_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def peak_held_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(slots=True)
class ShareTracker:
    """One process's share, from first contact to the pools' size.

    `start` checks the card (before anything large is allocated), `weights_loaded` records
    what the weights took, `measure_graphs` / `measure_headroom` run probes and keep what they
    took, `budget` gives the pools' bytes.
    """

    mem: DeviceMemory
    fraction: float
    total_bytes: int
    weights_bytes: int = 0
    graph_bytes: int = 0
    headroom_bytes: int = 0

    @classmethod
    def start(cls, mem: DeviceMemory, fraction: float) -> ShareTracker:
        """Raises MemoryBudgetError when the device's free memory cannot cover the share."""
        free, total = mem.mem_get_info()
        check_share_free(fraction, total, free, CONTEXT_BYTES + mem.held_bytes())
        return cls(mem, fraction, total)

    def weights_loaded(self) -> None:
        """Record what the loaded weights hold (the loader's freed temporaries returned)."""
        self.mem.release_cached()
        self.weights_bytes = CONTEXT_BYTES + self.mem.held_bytes()

    def measure_graphs(self, capture: Callable[[], Callable[[], None]]) -> int:
        """Run `capture` (which captures every graph over probe pools and returns the function
        that frees them and the probe pools) and keep the memory the graphs held."""
        before = self.mem.held_bytes()
        release = capture()
        self.graph_bytes = max(0, self.mem.held_bytes() - before)
        release()
        self.mem.release_cached()
        return self.graph_bytes

    def measure_headroom(self, probe: Callable[[], None]) -> int:
        """Run `probe` (eager work as large as the process will run outside graphs) and keep
        the peak it reached above what was held before it."""
        self.mem.release_cached()
        before = self.mem.held_bytes()
        self.mem.reset_peak()
        probe()
        self.headroom_bytes = max(0, self.mem.peak_held_bytes() - before)
        self.mem.release_cached()
        return self.headroom_bytes

    def budget(self) -> MemoryBudget:
        """Raises MemoryBudgetError when the share leaves nothing for the pools."""
        return plan_budget(self.fraction, self.total_bytes, self.weights_bytes,
                           self.graph_bytes, self.headroom_bytes)

    def check_graphs(self, actual_bytes: int) -> None:
        """Warn when the real capture took more than the probe measured (the pools may then
        crowd out other processes' shares)."""
        if actual_bytes > self.graph_bytes * 1.1 + 64 * 2**20:
            log.warning("CUDA graphs took %s, the probe measured %s", gib(actual_bytes),
                        gib(self.graph_bytes))
