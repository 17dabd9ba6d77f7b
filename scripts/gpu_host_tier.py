"""Host-tier copy bandwidth on CUDA: `HostKVPool.restore` (pinned host -> device, the real
call and its stream) against a plain pinned host-to-device copy of the same bytes, on
gpt-oss-20b's full-attention page shape (12 full layers, 8 KV heads of 64, bfloat16).

    python scripts/gpu_host_tier.py [--pages 256 --reps 5]
    python -m scripts.gpu_host_tier

Each restore moves `--pages` host pages into device pages, page ids shuffled as a pool in
steady state hands them out, timed from the call until its event is done (the host-side work
counts); the plain copy is one contiguous pinned tensor of the same bytes, `copy_` with
`non_blocking` on its own stream, timed the same way. The medians over `--reps`. The restored
pages are checked bit-equal, and a write's bandwidth (device -> pinned host) is printed too.
The last line is exactly

    gpu_host_tier: restore_gbps=<x> pinned_h2d_gbps=<x> ratio=<x>

(goal: ratio >= 0.8, issue 29). Without CUDA it prints `gpu_host_tier: skipped: no CUDA
device` and exits 0 (scripts/gpu_check.sh runs it on a GPU machine).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from decode_worker.core.host_tier import HostRestore, HostWrite
from decode_worker.device.host_pool import HostKVPool
from decode_worker.device.kv_pool import KVPools, KVSpec

PAGE = 16


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    """Seconds from the call until the work it queued is done (`fn` returns an event)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    event = fn()
    event.synchronize()
    return time.perf_counter() - t0


def _restore(host: HostKVPool, job: HostRestore) -> torch.cuda.Event:
    handle = host.restore(job)
    assert handle.event is not None
    return handle.event


def measure(pages: int, reps: int, seed: int) -> tuple[float, float, float]:
    """(restore GB/s, pinned H2D GB/s, write GB/s), medians over `reps`."""
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24))
    pools = KVPools(KVSpec(types, 8, 64), 4 * pages, 1, PAGE, "cuda", torch.bfloat16)
    host = HostKVPool(pools, 4 * pages)
    host.host.normal_()
    nbytes = pages * host.page_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    rng = random.Random(seed)

    def plain() -> torch.cuda.Event:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    restore_s, plain_s, write_s = [], [], []
    for _ in range(reps + 1):  # the first of each is a warm-up
        host_ids = rng.sample(range(1, 4 * pages + 1), pages)
        dev_ids = rng.sample(range(1, 4 * pages + 1), pages)
        restore_s.append(_timed(partial(_restore, host, HostRestore(host_ids, dev_ids))))
        if not torch.equal(pools.full[:, dev_ids].cpu(), host.host[:, host_ids]):
            raise SystemExit("gpu_host_tier: restored pages differ from the host pages")
        plain_s.append(_timed(plain))
        t0 = time.perf_counter()
        host.write(HostWrite(dev_ids, host_ids))
        host.sync_writes()
        write_s.append(time.perf_counter() - t0)
    gb = nbytes / 1e9
    return (gb / statistics.median(restore_s[1:]), gb / statistics.median(plain_s[1:]),
            gb / statistics.median(write_s[1:]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_host_tier", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=256, help="pages per restore (16 tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_host_tier: skipped: no CUDA device")
        return 0
    restore, h2d, write = measure(args.pages, args.reps, args.seed)
    mb = args.pages * 12 * 2 * PAGE * 8 * 64 * 2 / 1e6
    print(f"gpu_host_tier: {torch.cuda.get_device_name()}, {args.pages} pages ({mb:.0f} MB) per "
          f"copy: restore {restore:.1f} GB/s, pinned H2D {h2d:.1f} GB/s, write (device -> "
          f"pinned host, synced) {write:.1f} GB/s")
    print(f"gpu_host_tier: restore_gbps={restore:.2f} pinned_h2d_gbps={h2d:.2f} "
          f"ratio={restore / h2d:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
