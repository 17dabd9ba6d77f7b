"""How many pages each pool gets: a frozen runtime fact, never written back into settings.

Sizes come from `cache.num_full_pages` / `cache.num_swa_pages` when set; otherwise from a byte
budget (on CUDA: what this process's share of the device leaves after its weights, graphs and
headroom, `device/gpu_memory.py`, passed in by the caller; on CPU: `cache.cpu_pool_bytes`) split
between the pools by `cache.swa_pool_share`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_worker.device.kv_pool import KVSpec
from decode_worker.errors import ConfigError
from decode_worker.settings import CacheSettings


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Pool sizes and where they came from ("settings" or "budget")."""

    page_size: int
    num_full_pages: int
    num_swa_pages: int
    page_bytes: int  # one page of one full layer, K and V
    budget_bytes: int
    source: str
    swa_page_bytes: int | None = None  # one page of one sliding layer (None: page_bytes)

    def pool_bytes(self, spec: KVSpec) -> tuple[int, int]:
        """Bytes of the (full, swa) pool tensors, dummy page included."""
        full = spec.num_full_layers * (self.num_full_pages + 1) * self.page_bytes
        swa_page = self.swa_page_bytes or self.page_bytes
        swa = spec.num_swa_layers * (self.num_swa_pages + 1) * swa_page
        return full, swa


def plan_cache_layout(
    cache: CacheSettings,
    spec: KVSpec,
    device: torch.device,
    dtype: torch.dtype,
    budget_bytes: int | None = None,
) -> CacheLayout:
    """Decide the pool sizes. `budget_bytes`: the pools' bytes (on CUDA, from the process's
    share; default `cache.cpu_pool_bytes` on CPU, nothing on CUDA: explicit sizes only).

    Raises ConfigError when not even one page per pool fits, naming the setting to change.
    """
    page_bytes = spec.page_bytes(cache.page_size, dtype, "full")
    swa_page_bytes = spec.page_bytes(cache.page_size, dtype, "swa")
    if budget_bytes is None:
        budget_bytes = cache.cpu_pool_bytes if device.type != "cuda" else 0
    full_layer_bytes = max(spec.num_full_layers, 1) * page_bytes
    swa_layer_bytes = max(spec.num_swa_layers, 1) * swa_page_bytes
    share = cache.swa_pool_share if spec.num_swa_layers else 0.0
    derived_full = int(budget_bytes * (1.0 - share)) // full_layer_bytes - 1
    derived_swa = int(budget_bytes * share) // swa_layer_bytes - 1 if spec.num_swa_layers else 1
    num_full = cache.num_full_pages or derived_full
    num_swa = cache.num_swa_pages or derived_swa
    explicit = cache.num_full_pages is not None and cache.num_swa_pages is not None
    if num_full < 1 or num_swa < 1:
        where = "cache.memory_fraction" if device.type == "cuda" else "cache.cpu_pool_bytes"
        raise ConfigError(
            f"KV pools do not fit: budget {budget_bytes} B gives {num_full} full and {num_swa} "
            f"SWA pages of {page_bytes} B per layer; raise {where} or set cache.num_*_pages")
    return CacheLayout(
        page_size=cache.page_size, num_full_pages=num_full, num_swa_pages=num_swa,
        page_bytes=page_bytes, budget_bytes=budget_bytes,
        source="settings" if explicit else "budget", swa_page_bytes=swa_page_bytes)
