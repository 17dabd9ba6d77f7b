"""Plain value types shared across layers (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolName = Literal["full", "swa"]


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """One registered memory range: what the device layer hands to NIXL (never a tensor)."""

    addr: int
    length: int
    device_id: int
    kind: Literal["DRAM", "VRAM"]
