"""The host tier on CUDA (needs CUDA; auto-skipped): a write goes to pinned host memory on its
own stream, a restore returns a handle at once and copies on its own stream, and the restored
pages are bit-equal to the ones written. The engine's join gate polls `is_done()`.

Run on a GPU machine: `python -m pytest -q tests/gpu -x`.
"""

from __future__ import annotations

import time

import pytest
import torch

from decode_worker.core.host_tier import HostRestore, HostWrite
from decode_worker.device.host_pool import HostKVPool
from decode_worker.device.kv_pool import KVPools, KVSpec

pytestmark = pytest.mark.gpu


def test_restore_is_asynchronous_and_bit_exact() -> None:
    spec = KVSpec(("sliding_attention", "full_attention") * 2, 2, 16)
    pools = KVPools(spec, 64, 16, 16, "cuda", torch.bfloat16)
    pools.full.normal_()  # full: [2 layers, 65 pages, 2, 16, 2, 16] bf16
    host = HostKVPool(pools, 32)
    assert host.host.is_pinned()
    src, dst = list(range(1, 9)), list(range(20, 28))
    host.write(HostWrite(src, list(range(1, 9))))
    host.sync_writes()
    pools.full[:, dst] = 0
    handle = host.restore(HostRestore(list(range(1, 9)), dst))
    assert handle.event is not None and handle.num_pages == 8
    deadline = time.monotonic() + 30
    while not handle.is_done():  # the gate's poll: bounded
        assert time.monotonic() < deadline, "restore never completed"
    assert torch.equal(pools.full[:, dst], pools.full[:, src])
    handle.wait()  # done already: returns at once
