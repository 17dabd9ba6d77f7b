"""Admission pass cost with 1,000 queued and 256 running requests (pure core, no torch).

Prompts of ~1,000 tokens from 8 shared-prefix families, page 64, window 127 (gpt-oss). Prints
the cost per admitted request and per pass, for a pass that admits everything and for passes
blocked at the head of the line (the common idle case when the pool is full). Times are CPU time
(`process_time`: steadier than wall time on a shared machine), the best of `--repeat` runs. A
request's page keys are built when it is queued (`PreallocQueue.add`), so that cost is printed
too (queueing, per request).
Usage: python -m scripts.bench_admission [--queued 1000] [--running 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from decode_worker.core.admission import PreallocQueue, QueueLimits
from decode_worker.core.decode_alloc import DecodeAllocator
from decode_worker.core.kv_context import KVContext
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.request import DecodeRequest, RequestState, held_page_ids

PS, WIN = 64, 127


def _prompt(rng: random.Random, families: list[list[int]], i: int) -> list[int]:
    fam = families[i % len(families)]
    cut = rng.randrange(256, len(fam))
    return fam[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(16, 400))]


def _setup(  # type: ignore[no-untyped-def]
    n_running: int, n_queued: int, full_pages: int, swa_pages: int, seed: int
):
    rng = random.Random(seed)
    families = [[rng.randrange(50_000) for _ in range(900)] for _ in range(8)]
    full, swa = PageAllocator(full_pages, "full"), PageAllocator(swa_pages, "swa")
    tree = UnifiedRadixTree(PS, WIN, full, swa)
    lim = QueueLimits(max_queued=n_queued + n_running, max_active=None)
    ctx = KVContext(tree, full, swa, page_size=PS, window=WIN, radix_cache=True)
    q, dec = PreallocQueue(ctx, lim), DecodeAllocator(ctx)
    for i in range(n_running):
        q.add(DecodeRequest(f"run{i}", i, _prompt(rng, families, i), 256), 0.0)
    for d in q.pop_admitted(0.0):
        d.req.transition(RequestState.READY, 0.0, first_token=1)
        d.req.transition(RequestState.RUNNING, 0.0, keeper=dec.ctx)
    reqs = [DecodeRequest(f"q{i}", 10_000 + i, _prompt(rng, families, i), 256)
            for i in range(n_queued)]
    gc.collect()  # each timed phase starts from a collected heap: it pays its own garbage only
    t0 = time.process_time()
    for r in reqs:
        q.add(r, 1.0)
    add_us = (time.process_time() - t0) / max(1, n_queued) * 1e6
    return q, tree, full, add_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queued", type=int, default=1000)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    per_req, per_pass, blocked, adds = [], [], [], []
    for rep in range(a.repeat):
        q, tree, _, add_us = _setup(a.running, a.queued, 40_000, 12_000, rep)
        adds.append(add_us)
        gc.collect()
        t0 = time.process_time()
        got = q.pop_admitted(2.0)
        dt = time.process_time() - t0
        per_req.append(dt / max(1, len(got)) * 1e6)
        per_pass.append(dt * 1e6)
        # blocked passes: a pool with no room left, the head request waits every pass
        q2, _, full2, _ = _setup(a.running, a.queued, 40_000, 12_000, rep)
        full2.alloc(full2.num_free)  # nothing evictable is left either: running locks it
        t0 = time.process_time()
        for _ in range(100):
            assert q2.pop_admitted(3.0) == []
        blocked.append((time.process_time() - t0) / 100 * 1e6)
        tree.check_integrity(*held_page_ids(q.active_requests(), PS))
    print(f"admitted {len(got)} of {a.queued} queued with {a.running} running "
          f"(page {PS}, window {WIN}, {q.ctx.stats.prefix_hit_tokens_total} prefix-hit tokens)")
    print(f"admitting pass: {min(per_pass):.0f} us/pass, {min(per_req):.1f} us/admitted request")
    print(f"queueing (page keys built here): {min(adds):.1f} us/request")
    print(f"blocked pass (head waits): {min(blocked):.1f} us/pass")


if __name__ == "__main__":
    main()
