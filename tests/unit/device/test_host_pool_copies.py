"""`HostKVPool` on CPU: writes and restores move exactly the pages asked for, every full
layer, whether the host page ids form runs (one block each) or not; the torch copies the CUDA
path makes (`restore_runs`, `write_runs`: one block per host run, one indexed copy of the
device side) do the same on CPU tensors."""

from __future__ import annotations

import random

import pytest
import torch

from decode_worker.core.host_tier import HostRestore, HostWrite
from decode_worker.device.host_pool import (
    HostKVPool,
    RestoreFailed,
    host_runs,
    restore_runs,
    write_runs,
)
from decode_worker.device.kv_pool import KVPools, KVSpec

DEVICE_PAGES, HOST_PAGES = 40, 50


def _pool() -> HostKVPool:
    spec = KVSpec(("sliding_attention", "full_attention") * 2, 2, 8)
    return HostKVPool(KVPools(spec, DEVICE_PAGES, 4, 4, "cpu", torch.float32), HOST_PAGES)


def _ids(rng: random.Random, n: int, top: int, shape: str) -> list[int]:
    if shape == "scattered":
        return rng.sample(range(1, top + 1), n)
    start = rng.randint(1, top + 1 - n)
    ids = list(range(start, start + n))
    if shape == "down":
        ids.reverse()
    elif shape == "one break" and n > 3:
        ids[0], ids[n // 2] = ids[n // 2], ids[0]
    return ids


@pytest.mark.parametrize("shape", ["up", "down", "one break", "scattered"])
def test_write_and_restore_move_exactly_the_pages_asked_for(shape: str) -> None:
    rng = random.Random(shape)
    pool = _pool()
    dev = pool.pools.full
    for _ in range(40):
        n = rng.randint(1, 16)
        d_ids = _ids(rng, n, DEVICE_PAGES, rng.choice([shape, "up", "down"]))
        h_ids = _ids(rng, n, HOST_PAGES, shape)
        dev.normal_()
        pool.host.normal_()
        want_host = pool.host.clone()
        want_host[:, h_ids] = dev[:, d_ids]
        pool.write(HostWrite(d_ids, h_ids))
        assert torch.equal(pool.host, want_host)
        pool.host.normal_()
        want_dev = dev.clone()
        want_dev[:, d_ids] = pool.host[:, h_ids]
        handle = pool.restore(HostRestore(h_ids, d_ids))
        assert handle.is_done() and handle.num_bytes == n * pool.page_bytes
        assert torch.equal(dev, want_dev)


def test_a_failed_restore_copies_nothing() -> None:
    pool = _pool()
    pool.host.fill_(1.0)
    pool.fail_restores = 1
    with pytest.raises(RestoreFailed):
        pool.restore(HostRestore([1, 2], [3, 4]))
    assert not pool.pools.full.any()
    pool.restore(HostRestore([1, 2], [3, 4]))
    assert pool.pools.full[:, [3, 4]].eq(1.0).all()


@pytest.mark.parametrize("ids, want", [
    ([], []),
    ([7], [(0, 1, 7)]),
    ([3, 4, 5], [(0, 3, 3)]),
    ([5, 4, 3], [(0, 1, 5), (1, 2, 4), (2, 3, 3)]),
    ([1, 2, 9, 10, 11, 4], [(0, 2, 1), (2, 5, 9), (5, 6, 4)]),
])
def test_host_runs_split_ids_into_stretches_that_step_by_one(
        ids: list[int], want: list[tuple[int, int, int]]) -> None:
    assert host_runs(ids) == want


@pytest.mark.parametrize("chunk_pages", [1, 3, 64])
@pytest.mark.parametrize("shape", ["up", "down", "one break", "scattered"])
def test_the_torch_copies_of_the_cuda_path_move_exactly_the_pages_asked_for(
        shape: str, chunk_pages: int) -> None:
    rng = random.Random(f"torch {shape} {chunk_pages}")
    pool = _pool()  # its tensors: the CUDA path's copies run here on CPU ones
    dev, pages = pool.pools.full, pool.pages
    for _ in range(20):
        n = rng.randint(1, 16)
        d_ids = _ids(rng, n, DEVICE_PAGES, rng.choice([shape, "up", "down"]))
        h_ids = _ids(rng, n, HOST_PAGES, shape)
        dev.normal_()
        pages.normal_()
        want_host = pool.host.clone()
        want_host[:, h_ids] = dev[:, d_ids]
        write_runs(dev, pages, d_ids, host_runs(h_ids), chunk_pages)
        assert torch.equal(pool.host, want_host)
        pages.normal_()
        want_dev = dev.clone()
        want_dev[:, d_ids] = pool.host[:, h_ids]
        restore_runs(pages, dev, host_runs(h_ids), d_ids, chunk_pages)
        assert torch.equal(dev, want_dev)


def test_host_is_the_page_first_pool_seen_layer_first() -> None:
    pool = _pool()
    pool.pages[3, 1].fill_(2.0)  # host page 3, full layer 1
    assert pool.host[1, 3].eq(2.0).all() and pool.host.sum() == pool.host[1, 3].sum()
    assert pool.host.data_ptr() == pool.pages.data_ptr()
