"""`HostKVPool` on CPU: writes and restores move exactly the pages asked for, every full
layer, whether the page ids form runs (strided slice copies) or not (gather and scatter)."""

from __future__ import annotations

import random

import pytest
import torch

from decode_worker.core.host_tier import HostRestore, HostWrite
from decode_worker.device.host_pool import HostKVPool, RestoreFailed
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
