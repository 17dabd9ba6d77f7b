"""Pool tensor layout, byte offsets, memory regions and the pool-size planner."""

from __future__ import annotations

import pytest
import torch

from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.layout import plan_cache_layout
from decode_worker.errors import ConfigError, PageError
from decode_worker.settings import CacheSettings

SPEC = KVSpec(("sliding_attention", "full_attention") * 2, num_kv_heads=2, head_dim=16)


def test_pool_shapes_and_layer_slots_follow_the_contract() -> None:
    pools = KVPools(SPEC, num_full_pages=10, num_swa_pages=6, page_size=4, device="cpu",
                    dtype=torch.float32)
    assert pools.full.shape == (2, 11, 2, 4, 2, 16)
    assert pools.swa.shape == (2, 7, 2, 4, 2, 16)
    assert [pools.layer_slot(i) for i in range(4)] == [
        ("swa", 0), ("full", 0), ("swa", 1), ("full", 1)]
    assert pools.page_bytes("full") == pools.page_bytes("swa") == 2 * 4 * 2 * 16 * 4


def test_region_offset_is_the_address_of_that_page() -> None:
    pools = KVPools(SPEC, 10, 6, 4, "cpu", torch.bfloat16)
    for pool, tensor in (("full", pools.full), ("swa", pools.swa)):
        for layer, page in ((0, 0), (0, 5), (1, 3), (1, 6)):
            addr = tensor[layer, page].data_ptr() - tensor.data_ptr()
            assert pools.region_offset(pool, layer, page) == addr  # type: ignore[arg-type]
            assert tensor[layer, page].is_contiguous()
    with pytest.raises(PageError):
        pools.region_offset("swa", 0, 7)
    with pytest.raises(PageError):
        pools.region_offset("full", 2, 1)


def test_memory_regions_cover_each_pool_tensor() -> None:
    pools = KVPools(SPEC, 10, 6, 4, "cpu", torch.float32)
    regions = pools.memory_regions()
    assert [(r.addr, r.length, r.kind) for r in regions] == [
        (pools.full.data_ptr(), pools.full.numel() * 4, "DRAM"),
        (pools.swa.data_ptr(), pools.swa.numel() * 4, "DRAM")]
    assert sum(r.length for r in regions) == pools.total_bytes()


def test_layout_splits_the_cpu_budget_by_swa_share() -> None:
    cache = CacheSettings(page_size=16, cpu_pool_bytes=2**20, swa_pool_share=0.25)
    layout = plan_cache_layout(cache, SPEC, torch.device("cpu"), torch.float32)
    page = SPEC.page_bytes(16, torch.float32)
    assert layout.source == "budget"
    assert layout.num_full_pages == int(2**20 * 0.75) // (2 * page) - 1
    assert layout.num_swa_pages == int(2**20 * 0.25) // (2 * page) - 1
    full_b, swa_b = layout.pool_bytes(SPEC)
    assert full_b + swa_b <= 2**20


def test_layout_takes_explicit_sizes_and_rejects_a_budget_too_small() -> None:
    cache = CacheSettings(num_full_pages=7, num_swa_pages=3)
    layout = plan_cache_layout(cache, SPEC, torch.device("cpu"), torch.float32)
    assert (layout.num_full_pages, layout.num_swa_pages, layout.source) == (7, 3, "settings")
    with pytest.raises(ConfigError, match="cpu_pool_bytes"):
        plan_cache_layout(CacheSettings(cpu_pool_bytes=100), SPEC, torch.device("cpu"),
                          torch.float32)


def test_cuda_layout_takes_the_pool_bytes_of_the_share() -> None:
    """On CUDA the caller passes what the process's share leaves for the pools
    (tests/unit/device/test_gpu_share.py); without it only explicit sizes fit."""
    gib = 2**30
    cache = CacheSettings(page_size=64, memory_fraction=0.85, swa_pool_share=0.15)
    layout = plan_cache_layout(cache, SPEC, torch.device("cuda"), torch.bfloat16,
                               budget_bytes=60 * gib)
    full_b, swa_b = layout.pool_bytes(SPEC)
    assert 60 * gib - 4 * layout.page_bytes <= full_b + swa_b <= 60 * gib
    with pytest.raises(ConfigError, match="memory_fraction"):
        plan_cache_layout(cache, SPEC, torch.device("cuda"), torch.bfloat16)
