"""Paged KV pools: one tensor for the full-attention layers, one for the sliding-window layers.

Layout (docs/CONTRACTS.md, "Device pools"):

    full: [num_full_layers, num_full_pages + 1, 2, page_size, num_kv_heads, head_dim]
    swa:  [num_swa_layers,  num_swa_pages + 1,  2, page_size, swa_kv_heads, swa_head_dim]

Index 2 is K (0) then V (1); K is stored after RoPE. Each pool has the KV shape of its layer
type (`KVSpec.shape`): the same for most models, other head counts or sizes for the sliding
layers of "SWA-compress" models; a model without sliding layers has an empty SWA pool.
Page 0 of each pool is the reserved dummy page (CUDA-graph padding writes there; an SWA page
id 0 means "not held"). One page of one layer,
K and V together, is one contiguous run of `page_bytes(pool)` bytes, so the byte offset of
(pool, layer, page) is `(layer * (num_pages + 1) + page) * page_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from decode_worker.core.types import MemoryRegion, PoolName
from decode_worker.device.model.arch import FULL, SLIDING, KVShape
from decode_worker.device.model.base import ArchFacts
from decode_worker.errors import PageError


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What the pools need to know about the model: which layer is which, and the KV shape of
    each layer type (`swa_shape` None: the sliding layers store what the full ones do)."""

    layer_types: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    swa_shape: KVShape | None = None

    @classmethod
    def from_config(cls, cfg: ArchFacts) -> KVSpec:
        full, swa = cfg.kv_shape(FULL), cfg.kv_shape(SLIDING)
        return cls(cfg.layer_types, full.num_kv_heads, full.head_dim,
                   None if swa == full else swa)

    def shape(self, pool: PoolName) -> KVShape:
        """The KV one token of one layer of `pool` stores."""
        full = KVShape(self.num_kv_heads, self.head_dim)
        return (self.swa_shape or full) if pool == "swa" else full

    @property
    def num_swa_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == SLIDING)

    @property
    def num_full_layers(self) -> int:
        return len(self.layer_types) - self.num_swa_layers

    def page_bytes(self, page_size: int, dtype: torch.dtype, pool: PoolName = "full") -> int:
        """Bytes of one page of one layer of `pool`, K and V together."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return page_size * self.shape(pool).values_per_token * itemsize


class KVPools:
    """Owns the two pool tensors. Not thread-safe: only the compute thread touches them."""

    def __init__(
        self,
        spec: KVSpec,
        num_full_pages: int,
        num_swa_pages: int,
        page_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if num_full_pages < 1 or page_size < 1 or num_swa_pages < 0:
            raise PageError(f"pool sizes must be positive: full={num_full_pages} "
                            f"swa={num_swa_pages} page_size={page_size}")
        self.spec = spec
        self.page_size = page_size
        self.num_pages: dict[PoolName, int] = {"full": num_full_pages, "swa": num_swa_pages}
        self.device = torch.device(device)
        self.dtype = dtype
        full, swa = spec.shape("full"), spec.shape("swa")
        # full: [num_full_layers, num_full_pages + 1, 2, page_size, kv_heads, head_dim]
        self.full = torch.zeros(
            (spec.num_full_layers, num_full_pages + 1, full.num_buffers, page_size,
             full.num_kv_heads, full.head_dim), dtype=dtype, device=self.device)
        # swa: [num_swa_layers, num_swa_pages + 1, 2, page_size, swa_kv_heads, swa_head_dim]
        self.swa = torch.zeros(
            (spec.num_swa_layers, num_swa_pages + 1, swa.num_buffers, page_size,
             swa.num_kv_heads, swa.head_dim), dtype=dtype, device=self.device)
        self._slots: list[tuple[PoolName, int]] = []
        counts = {"full": 0, "swa": 0}
        for t in spec.layer_types:
            pool: PoolName = "swa" if t == SLIDING else "full"
            self._slots.append((pool, counts[pool]))
            counts[pool] += 1

    def layer_slot(self, layer: int) -> tuple[PoolName, int]:
        """Model layer -> (pool name, index of that layer within the pool tensor)."""
        return self._slots[layer]

    def layer_tensor(self, layer: int) -> torch.Tensor:
        """The pages of one model layer: [num_pages + 1, 2, page_size, kv_heads, head_dim]."""
        pool, index = self._slots[layer]
        return self.tensor(pool)[index]

    def tensor(self, pool: PoolName) -> torch.Tensor:
        return self.full if pool == "full" else self.swa

    def page_bytes(self, pool: PoolName) -> int:
        """Bytes of one page of one layer in `pool`."""
        return self.spec.page_bytes(self.page_size, self.dtype, pool)

    def region_offset(self, pool: PoolName, layer_index: int, page_id: int) -> int:
        """Byte offset of (layer_index within pool, page_id) from the pool tensor's base address.

        Raises PageError for a layer index or page id outside the pool.
        """
        num_layers = self.tensor(pool).shape[0]
        if not 0 <= layer_index < num_layers or not 0 <= page_id <= self.num_pages[pool]:
            raise PageError(f"{pool} pool: layer {layer_index} page {page_id} out of range "
                            f"({num_layers} layers, pages 1..{self.num_pages[pool]})")
        return (layer_index * (self.num_pages[pool] + 1) + page_id) * self.page_bytes(pool)

    def memory_regions(self) -> list[MemoryRegion]:
        """One region per pool tensor (full first, then swa); empty pools are left out."""
        regions = []
        for t in (self.full, self.swa):
            if t.numel() == 0:
                continue
            kind: Literal["DRAM", "VRAM"] = "VRAM" if t.is_cuda else "DRAM"
            regions.append(MemoryRegion(
                addr=t.data_ptr(), length=t.numel() * t.element_size(),
                device_id=t.device.index or 0, kind=kind))
        return regions

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.full, self.swa))
