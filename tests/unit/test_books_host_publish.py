"""The books publish the host tier's pages and counters only when they moved: a host tier
without traffic costs no metric call per publish (`scripts/bench_step.py --compare-host-tier`),
and any change is published at the next one."""

from __future__ import annotations

from typing import Any

import torch

from decode_worker.core.host_tier import WritePolicy
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.daemon.decode.books import Books
from decode_worker.daemon.decode.host_tier import HostTier
from decode_worker.daemon.shared.host_plan import HostPlan
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.config import FULL
from decode_worker.io.metrics import Metrics
from tests.fakes.fake_device import FakeDeviceRunner, FakeIdleReceiver, running_stepper

PAGE = 16


def _books() -> tuple[Books, HostTier, list[str]]:
    """Books over two running requests on a tree with a write-through host tier; the pools
    each publish sets, in order, are recorded."""
    made: list[HostTier] = []

    def tree(full: PageAllocator, swa: PageAllocator) -> UnifiedRadixTree:
        pools = KVPools(KVSpec((FULL,), 1, 1), full.num_total, 1, PAGE, "cpu", torch.float16)
        ht = HostTier(HostPlan(2 * full.num_total, pools.page_bytes("full"), PAGE,
                               "write_through", "test"), pools)
        t = UnifiedRadixTree(PAGE, 127, full, swa, host=ht.pages,
                             write_policy=WritePolicy.WRITE_THROUGH)
        ht.attach(t)
        made.append(ht)
        return t

    stepper = running_stepper(FakeDeviceRunner(0.0), 2, 64, False, tree=tree)
    table = stepper.table
    books = Books(table.kv_ctx, table, FakeIdleReceiver(), stepper, Metrics(), made[0])
    pools_set: list[str] = []
    update_pool = books.metrics.update_pool

    def recording(pool: str, **kw: Any) -> None:
        pools_set.append(pool)
        update_pool(pool, **kw)

    books.metrics.update_pool = recording  # type: ignore[method-assign]
    return books, made[0], pools_set


def test_an_unchanged_host_tier_is_not_published_again_and_a_change_is() -> None:
    books, ht, pools_set = _books()
    books.publish(0.0)
    assert pools_set.count("host") == 1
    used = books.host_live["pages_used"]
    assert used > 0  # the prompts were written through
    for t in (1.0, 2.0, 3.0):
        books.publish(t)
    assert pools_set.count("host") == 1  # nothing moved: no host metric touched
    assert pools_set.count("full") == 4  # the device pools are published each time
    tree = books.kv_ctx.tree
    assert tree is not None
    # a turn nobody holds: written through to the host tier, then demoted by device eviction
    tokens = list(range(300, 300 + 2 * PAGE))
    tree.insert(tokens, tree.full.alloc(2), [0, 0], 2 * PAGE)
    assert tree.evict_full(2)
    books.publish(4.0)
    assert pools_set.count("host") == 2
    assert books.host_live["pages_evictable"] > 0
    ht.restore_failures_total += 1  # any counter moving is published too
    books.publish(5.0)
    assert pools_set.count("host") == 3 and books.host_live["restore_failures"] == 1
