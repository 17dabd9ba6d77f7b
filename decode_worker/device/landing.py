"""The landing area: where a prefill that lays the model out with full KV in every layer (a
stock SGLang prefill of Gemma 3) writes, and the copy from it into the pools.

    landing: [num_layers, num_pages + 1, 2, page_size, kv_heads, head_dim]   (model layer order)

One page of one layer is laid out as in the pools (K of its tokens, then V), so the SGLang
layout bridge addresses it as it addresses a pool. Page 0 is never handed out. The books of
which transfer holds which page are `core.landing`'s; this module only holds the memory and
copies a `LandingPlan`'s pages out.
"""

from __future__ import annotations

from typing import Literal

import torch

from decode_worker.core.landing import LandingPlan
from decode_worker.core.types import MemoryRegion
from decode_worker.device.kv_pool import KVPools
from decode_worker.errors import ConfigError


def landing_bytes_per_page(pools: KVPools) -> int:
    """Bytes of one landing page (every layer)."""
    return len(pools.spec.layer_types) * pools.page_bytes("full")


class LandingArea:
    """The landing tensor beside `pools` (same device, dtype, page size and KV shape). Raises
    ConfigError for sliding layers of another KV shape than the full ones (SGLang lays such
    "SWA-compress" models out with SWA pools, never as ordinary ones)."""

    def __init__(self, pools: KVPools, num_pages: int) -> None:
        spec = pools.spec
        if spec.swa_shape is not None or num_pages < 1:
            raise ConfigError(f"landing area: {num_pages} pages for a model whose sliding "
                              "layers store what its full layers do")
        self.pools, self.num_pages = pools, num_pages
        shape = spec.shape("full")
        # landing: [num_layers, num_pages + 1, 2, page_size, kv_heads, head_dim]
        self.tensor = torch.zeros(
            (len(spec.layer_types), num_pages + 1, shape.num_buffers, pools.page_size,
             shape.num_kv_heads, shape.head_dim), dtype=pools.dtype, device=pools.device)
        dev = pools.device
        slots = [pools.layer_slot(i) for i in range(len(spec.layer_types))]
        # model layers of each pool, in the pool's order: [num_full_layers] / [num_swa_layers] i64
        self._full_layers = torch.tensor([i for i, (p, _) in enumerate(slots) if p == "full"],
                                         dtype=torch.long, device=dev)
        self._swa_layers = torch.tensor([i for i, (p, _) in enumerate(slots) if p == "swa"],
                                        dtype=torch.long, device=dev)
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    @property
    def page_bytes(self) -> int:
        """One landing page of every layer."""
        return landing_bytes_per_page(self.pools)

    def memory_region(self) -> MemoryRegion:
        t = self.tensor
        kind: Literal["DRAM", "VRAM"] = "VRAM" if t.is_cuda else "DRAM"
        return MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), t.device.index or 0, kind)

    def copy_out(self, plan: LandingPlan) -> None:
        """Copy `plan`'s landed pages into the pools: every page of the full layers, the
        window's pages of the sliding layers. Returns once the copy is done (on CUDA: on a
        side stream the compute stream then waits for), so the landing pages may be written
        again at once."""
        if self._stream is None:
            self._copy(plan)
            return
        with torch.cuda.stream(self._stream):
            self._copy(plan)
        torch.cuda.current_stream(self.pools.device).wait_stream(self._stream)
        self._stream.synchronize()

    def _copy(self, plan: LandingPlan) -> None:
        dev, pools = self.pools.device, self.pools
        src = torch.tensor(plan.page_ids, dtype=torch.long, device=dev)  # [n] i64
        full_dst = torch.tensor(plan.full_dst, dtype=torch.long, device=dev)  # [n] i64
        # [num_full_layers, n, 2, page_size, kv_heads, head_dim]
        pools.full.index_copy_(1, full_dst, self.tensor[self._full_layers[:, None], src[None]])
        if plan.swa_dst and len(self._swa_layers):
            win = src[plan.swa_first:]  # [w] i64: the window's landing pages
            swa_dst = torch.tensor(plan.swa_dst, dtype=torch.long, device=dev)  # [w] i64
            # [num_swa_layers, w, 2, page_size, kv_heads, head_dim]
            pools.swa.index_copy_(1, swa_dst, self.tensor[self._swa_layers[:, None], win[None]])
