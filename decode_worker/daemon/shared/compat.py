"""The facts both sides of a transfer derive from their model and pools: what a peer must match
(`model_compat`) and where each region lies (`region_layouts`)."""

from __future__ import annotations

from decode_worker.device.aux_buffer import ROW_BYTES, AuxBuffer
from decode_worker.device.kv_pool import KVPools
from decode_worker.device.landing import LandingArea
from decode_worker.device.runner import ModelRunner
from decode_worker.io.kv import protocol as p


def region_layouts(pools: KVPools, aux: AuxBuffer) -> dict[str, p.RegionLayout]:
    """The "full", "swa" and "aux" RegionLayouts of a worker's pools (both sides use this)."""
    out: dict[str, p.RegionLayout] = {}
    for name in ("full", "swa"):
        t = pools.tensor(name)
        out[name] = p.RegionLayout(
            name, t.data_ptr(), t.shape[0], t.shape[1], pools.page_bytes(name),
            t.device.index or 0, "VRAM" if t.is_cuda else "DRAM",
        )  # fmt: skip
    region = aux.memory_region()
    out["aux"] = p.RegionLayout("aux", region.addr, 1, aux.num_rows, ROW_BYTES, 0, "DRAM")
    return out


def landing_region(area: LandingArea) -> p.RegionLayout:
    """The landing area as one region of every model layer, rows of one page (K and V)."""
    t = area.tensor
    return p.RegionLayout("landing", t.data_ptr(), t.shape[0], t.shape[1],
                          area.pools.page_bytes("full"), t.device.index or 0,
                          "VRAM" if t.is_cuda else "DRAM")


def model_compat(runner: ModelRunner, model_name: str) -> p.ModelCompat:
    """What a peer must match: taken from the loaded model and the pools."""
    pools, cfg = runner.pools, runner.model.cfg
    kinds: list[str] = [pools.layer_slot(i)[0] for i in range(len(cfg.layer_types))]
    return p.ModelCompat(
        model_name, str(pools.dtype).removeprefix("torch."), kinds, cfg.num_key_value_heads,
        cfg.head_dim, pools.page_size, cfg.window,
    )  # fmt: skip
