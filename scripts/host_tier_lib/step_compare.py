"""`scripts/bench_step.py --compare-host-tier`: host time per engine step with the decode radix
cache on, the host tier off and on without host traffic, side by side in one run.

Each side is stepped as `DecodeEngine.step` steps a busy worker with nothing arriving: the request
table's poll (no transfer in flight), the host tier's poll (on: no restore in flight), the
decode step over `bs` running requests (the stand-in runner at 2 ms, overlap) and the books'
publish (load every step; gauges and counters, the host tier's pages and counters when on, at
most every `PUBLISH_EVERY_S`). The "on" side has the real `HostTier` (`daemon/decode/
host_tier.py`: host page allocator, host KV pool on a small CPU pool layout, the tree's write
sink) with the default write policy; the prompts' host copies are made while the sides are built
(not timed), and the run fails if anything is written, demoted or restored while it is timed.
The two sides take turns step by step (which goes first alternates) so that this shared
machine's drift hits both. What cannot run here is the KV receiver: `FakeIdleReceiver` (no
transfer, no peer) stands in for it.
"""

from __future__ import annotations

import statistics
import time

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
from decode_worker.settings import CacheSettings
from tests.fakes.fake_device import FakeDeviceRunner, FakeIdleReceiver, running_stepper

PAGE, WINDOW = 16, 127


class EngineSide:
    """One side: a running stepper over a radix tree with (`host`) or without a host tier, its
    request table and its books, stepped as the engine steps them."""

    def __init__(self, host: bool, bs: int, ctx: int) -> None:
        self.host_tier: HostTier | None = None
        self.runner = FakeDeviceRunner(2.0)
        self.stepper = running_stepper(self.runner, bs, ctx, True, page_size=PAGE,
                                       window=WINDOW, tree=self._tree if host else _plain_tree)
        table = self.stepper.table
        self.books = Books(table.kv_ctx, table, FakeIdleReceiver(), self.stepper, Metrics(),
                           self.host_tier)
        tree = table.kv_ctx.tree
        assert tree is not None
        self.tree = tree
        self.traffic = self._traffic()

    def _tree(self, full: PageAllocator, swa: PageAllocator) -> UnifiedRadixTree:
        """The tree with the real host tier (the engine's wiring), on a one-layer CPU pool
        layout of `full`'s pages (the copies' size does not matter: none is timed)."""
        spec = KVSpec((FULL,), num_kv_heads=1, head_dim=1)
        pools = KVPools(spec, full.num_total, 1, PAGE, "cpu", torch.float16)
        policy = CacheSettings().hicache_write_policy
        plan = HostPlan(2 * full.num_total, pools.page_bytes("full"), PAGE, policy, "bench")
        ht = self.host_tier = HostTier(plan, pools)
        tree = UnifiedRadixTree(PAGE, WINDOW, full, swa, host=ht.pages,
                                write_policy=WritePolicy(policy))
        ht.attach(tree)
        return tree

    def _traffic(self) -> tuple[int, int, int, int]:
        """Host pages written, demoted, promoted and restored so far."""
        st, ht = self.tree.host_stats, self.host_tier
        return (st.written_pages_total, st.demoted_pages_total, st.promoted_pages_total,
                ht.restored_pages_total if ht is not None else 0)

    def step(self, now: float) -> float:
        """One engine step (table poll, host tier poll, decode step, publish): its host ms,
        the stand-in's simulated device time and forward math not counted."""
        runner = self.runner
        runner.wait_s = runner.wait_cpu_s = runner.compute_cpu_s = 0.0
        cpu0 = time.thread_time()
        self.stepper.table.poll(now)
        if self.host_tier is not None:
            self.host_tier.count_done_restores(now)
        self.stepper.step(now)
        self.books.publish(now, decoding=True)
        self.stepper.table.outbox.flush()
        return (time.thread_time() - cpu0 - runner.wait_cpu_s - runner.compute_cpu_s) * 1e3

    def close(self) -> None:
        if self.stepper.busy:  # commit the last launched step (not timed)
            self.stepper.step(time.monotonic())
        if self._traffic() != self.traffic:
            raise SystemExit("bench_step: host traffic while the no-traffic steps ran")


def _plain_tree(full: PageAllocator, swa: PageAllocator) -> UnifiedRadixTree:
    return UnifiedRadixTree(PAGE, WINDOW, full, swa)


def _trimmed_mean(xs: list[float]) -> float:
    """The mean without the lowest and highest tenth: a step that publishes (every few steps)
    counts as often as it happens, a step this shared machine stalled does not."""
    xs = sorted(xs)
    cut = len(xs) // 10
    return statistics.fmean(xs[cut : len(xs) - cut])


def measure_host_tier(bs: int, ctx: int, steps: int, repeats: int) -> tuple[float, float, float]:
    """Host ms per engine step, host tier off and on: (median off, median on, median over
    `repeats` pairs of the on / off ratio), each side's value being its trimmed mean over
    `steps` steps (not the median: the publish runs every few steps, not in most)."""
    off, on = [], []
    for _ in range(repeats):
        sides = (EngineSide(False, bs, ctx), EngineSide(True, bs, ctx))
        hosts: tuple[list[float], list[float]] = ([], [])
        for i in range(steps + 3):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                host = sides[k].step(time.monotonic())
                if i >= 3:  # warm-up steps are not counted
                    hosts[k].append(host)
        for side in sides:
            side.close()
        off.append(_trimmed_mean(hosts[0]))
        on.append(_trimmed_mean(hosts[1]))
    ratio = statistics.median(b / a for a, b in zip(off, on, strict=True))
    return statistics.median(off), statistics.median(on), ratio


def print_host_tier(sizes: list[int], ctxs: list[int], steps: int, repeats: int) -> None:
    """One line per (bs, ctx), then the worst ratio (goal <= 1.03)."""
    worst = 0.0
    for bs in sizes:
        for ctx in ctxs:
            off, on, ratio = measure_host_tier(bs, ctx, steps, repeats)
            worst = max(worst, ratio)
            print(f"host tier (radix on, fake 2 ms, overlap), bs {bs} x {ctx}: host off "
                  f"{off:.3f} ms, on without traffic {on:.3f} ms (x{ratio:.3f}, median of "
                  f"{repeats} pairs)", flush=True)
    print(f"bench_step host tier: worst no-traffic ratio {worst:.3f} (goal <= 1.03)")

