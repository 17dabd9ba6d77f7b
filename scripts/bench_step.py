#!/usr/bin/env python3
"""Host time per decode step (schedule + prepare + commit), and how well it hides behind the device.

Drives the daemon's own `DecodeStepper` (page planning in the core, persistent inputs, sampling,
commit to the request table and the outbox) over `bs` running requests of `ctx`-token contexts:
- with `FakeDeviceRunner` (tests/fakes): a forward that takes 2 ms or 10 ms of simulated device
  time without holding the host, overlap on and off. Host time = the step's CPU time outside
  the wait for the device and outside the stand-in's forward math (device work on a GPU: see
  tests/fakes/fake_device.py); with overlap the step should last the device time (ratio = step
  wall time / device time). Request i's context is `ctx - i % 16` tokens, so page edges spread
  over the steps as in a real batch.
- with the real CPU model (tiny gpt-oss) where its pools fit: host time = the step's CPU time
  outside the forward (CPU runs it eagerly, so there is nothing to overlap).

    python scripts/bench_step.py                 # about three minutes on two cores
    python -m scripts.bench_step                 # the same, as a module
    python -m scripts.bench_step --steps 100 --no-real-model
    python -m scripts.bench_step --compare-host-tier --steps 60   # host tier off vs on

`--compare-host-tier` runs only the side-by-side of the host tier (radix cache on, stand-in
at 2 ms, overlap): off vs on with no host traffic, per batch size and context, each side
stepped as the engine steps it (fetcher and host-tier polls, decode step, the books' publish:
`scripts/host_tier_lib/step_compare.py`).

A row with speculative decoding on (NGRAM K=8, bs 64 x 8k at 2 ms; `scripts/step_lib/`) shows
what speculation adds to a plain overlapped step; its step/dev ratio counts in the worst.

Last line: `bench_step: host_ms_256x32k=<ms> overlap_ratio_max=<step time / device time, worst>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.fakes` as a plain file

import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.utils.mathx import cdiv
from scripts.step_lib.timing import timed_steps
from tests.fakes.fake_device import FakeDeviceRunner, running_stepper

PAGE = 16


class _TimedRunner:
    """A real runner whose forward time is counted as device time (CPU runs it eagerly)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.wait_s, self.wait_cpu_s, self.compute_cpu_s = inner, 0.0, 0.0, 0.0

    def new_inputs(self, num_rows: int) -> Any:
        return self.inner.new_inputs(num_rows)

    def decode_rows(self, inputs: Any, rows: list[int], positions: list[int]) -> Any:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        out = self.inner.decode_rows(inputs, rows, positions)
        self.wait_s += time.perf_counter() - t0
        self.wait_cpu_s += time.thread_time() - cpu0
        return out

    def fetch_tokens(self, chosen: torch.Tensor, extras: tuple[torch.Tensor, ...] = ()) -> Any:
        return self.inner.fetch_tokens(chosen, extras)


def measure(make_runner: Any, bs: int, ctx: int, overlap: bool, steps: int, repeats: int = 1,
            params: SamplingParams | None = None) -> tuple[float, float]:
    """(host ms, wall ms) per step: medians over `steps` steady-state steps, then the median of
    `repeats` runs (this machine's speed drifts by up to 2x over seconds). Host time is the
    compute thread's CPU time outside the (simulated) device, so a shared machine's preemption
    does not count as host work; the wall time is what the step lasted."""
    runs = [_measure(make_runner(), bs, ctx, overlap, steps, params) for _ in range(repeats)]
    return (statistics.median(h for h, _ in runs), statistics.median(w for _, w in runs))


def _measure(runner: Any, bs: int, ctx: int, overlap: bool, steps: int,
             params: SamplingParams | None) -> tuple[float, float]:
    stepper = running_stepper(runner, bs, ctx, overlap, params=params)
    # warm-up: rows written, the pipeline full
    hosts, walls = timed_steps(stepper, runner, 3, steps)
    return statistics.median(hosts), statistics.median(walls)


def real_runner(bs: int, ctx: int, budget_bytes: int) -> Any | None:
    """The tiny gpt-oss on CPU with pools for `bs` x `ctx`, or None when they exceed the budget
    or the model's context."""
    from decode_worker.device.default_model import write_model
    from decode_worker.device.kv_pool import KVPools, KVSpec
    from decode_worker.device.model.weights import load_model
    from decode_worker.device.runner import ModelRunner

    global _MODEL
    if _MODEL is None:
        tmp = tempfile.mkdtemp()
        _MODEL = load_model(write_model(Path(tmp) / "tiny", seed=0), "cpu", torch.float32)
    spec = KVSpec.from_config(_MODEL.cfg)
    full, swa = bs * (cdiv(ctx, PAGE) + 64) + 8, bs * 16 + 8
    if ctx + 64 > _MODEL.cfg.max_position_embeddings:
        return None
    if (full + swa) * PAGE * spec.head_dim * spec.num_kv_heads * 2 * 4 * len(_MODEL.layers) \
            > budget_bytes:
        return None
    pools = KVPools(spec, full, swa, PAGE, "cpu", torch.float32)
    return _TimedRunner(ModelRunner(_MODEL, pools, use_cuda_graph=False, graph_batch_sizes=[1]))


_MODEL: Any = None


def measure_kv_events(bs: int, ctx: int, steps: int,
                      repeats: int) -> tuple[float, float, float]:
    """Host ms per step with KV events off and on (medians of medians), and the median of the
    per-step differences on - off (median over repeats), steps interleaved.

    Each step also does what a busy engine's tree does: one request's turn (one of 8 cached
    1024-token prefixes, then 256 fresh tokens: 16 new pages) goes into a radix tree whose pool
    is full, so the oldest turn is evicted (16 pages).
    With events on the tree records them (page references; the hashes are computed by the
    reader), the hub appends the step's batch, and a ZMQ publisher thread hashes, encodes and
    sends it to a subscriber that drains it on another thread.
    Two stacks, one with events off and one with them on, take turns step by step (which goes
    first alternates), so this shared machine's speed drift, up to 2x over seconds, hits both
    alike; the publisher and subscriber threads run throughout."""
    off, on, diff = [], [], []
    for _ in range(repeats):
        stacks = (_EventsStack(False, bs, ctx), _EventsStack(True, bs, ctx))
        try:
            hosts: tuple[list[float], list[float]] = ([], [])
            for i in range(steps + 3):
                for k in ((0, 1) if i % 2 else (1, 0)):
                    host = stacks[k].step(i)
                    if i >= 3:  # warm-up steps are not counted
                        hosts[k].append(host)
        finally:
            for stack in stacks:
                stack.close()
        off.append(statistics.median(hosts[0]))
        on.append(statistics.median(hosts[1]))
        diff.append(statistics.median(b - a for a, b in zip(*hosts, strict=True)))
    return statistics.median(off), statistics.median(on), statistics.median(diff)


class _EventsStack:
    """A running stepper and a radix tree, with KV events off or on (then a hub, a ZMQ
    publisher and a draining subscriber)."""

    def __init__(self, events: bool, bs: int, ctx: int) -> None:
        import threading

        import zmq

        from decode_worker.core.pages import PageAllocator
        from decode_worker.core.radix_tree import UnifiedRadixTree
        from decode_worker.io.kv_events.hub import KvEventHub
        from decode_worker.io.kv_events.publisher import ZmqKvEventPublisher
        from decode_worker.settings.kv_events import parse_kv_events_config

        self.runner = FakeDeviceRunner(2.0)
        self.stepper = running_stepper(self.runner, bs, ctx, True)
        self.tree = UnifiedRadixTree(PAGE, 127, PageAllocator(1024, "full"), None,
                                     kv_events=events)
        for i in range(-48, 0):  # fill the pool: every measured turn evicts the oldest one
            _turn(self.tree, i)
        self.tree.take_events()
        self.hub = KvEventHub(10_000) if events else None
        self.pub: Any = None
        self.stop = threading.Event()
        if self.hub is not None:
            self.pub = ZmqKvEventPublisher.bind(parse_kv_events_config(
                {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}))
            self.pub.start(self.hub)
            self.sub = zmq.Context.instance().socket(zmq.SUB)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(self.pub.endpoint)
            self.drain = threading.Thread(target=_drain, args=(self.sub, self.stop), daemon=True)
            self.drain.start()

    def step(self, i: int) -> float:
        """One decode step and one turn (published when events are on): its host ms."""
        runner = self.runner
        runner.wait_s = runner.wait_cpu_s = runner.compute_cpu_s = 0.0
        cpu0 = time.thread_time()
        self.stepper.step(time.monotonic())
        self.stepper.table.outbox.flush()
        _turn(self.tree, i)
        if self.hub is not None:
            self.hub.publish_step(self.tree)
        return (time.thread_time() - cpu0 - runner.wait_cpu_s - runner.compute_cpu_s) * 1e3

    def close(self) -> None:
        self.stop.set()
        if self.pub is not None:
            self.drain.join(1.0)
            self.pub.close()
            self.sub.close(0)
        if self.stepper.busy:  # commit the last launched step
            self.stepper.step(time.monotonic())


def _turn(tree: Any, i: int) -> None:
    """One request's turn into `tree`: one of 8 hot 1024-token prefixes, then 256 new tokens
    (16 pages); once the pool is full the oldest turn's 16 pages are evicted."""
    toks = [i % 8] * 1024 + [(i * 131 + j) % 50_000 for j in range(256)]
    need = len(toks) // PAGE  # the caller's pages; the insert frees the 64 duplicates
    if tree.full.num_free < need:
        tree.evict_full(need - tree.full.num_free)
    tree.insert(toks, tree.full.alloc(need), [], 0)


def _drain(sock: Any, stop: Any) -> None:
    while not stop.is_set():
        if sock.poll(10):
            sock.recv_multipart()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--device-ms", default="2,10", help="simulated device time per step")
    p.add_argument("--no-real-model", action="store_true")
    p.add_argument("--no-fake", action="store_true", help="only the real CPU model")
    p.add_argument("--repeats", type=int, default=3, help="runs per stand-in cell (median)")
    p.add_argument("--real-steps", type=int, default=4)
    p.add_argument("--real-budget-mib", type=int, default=1024, help="largest real KV pools")
    p.add_argument("--compare-host-tier", action="store_true",
                   help="only the host tier off vs on without host traffic (radix cache on)")
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    ctxs = [int(c) for c in args.contexts.split(",")]
    if args.compare_host_tier:
        from scripts.host_tier_lib.step_compare import print_host_tier

        print_host_tier(sizes, ctxs, args.steps, max(args.repeats, 5))
        return
    host_256x32k, worst = float("nan"), 0.0
    print(f"{'runner':<18}{'bs':>5}{'ctx':>7}  {'overlap':<8}{'host ms':>9}{'step ms':>9}"
          f"{'step/dev':>9}")
    for dev_ms in [] if args.no_fake else [float(d) for d in args.device_ms.split(",")]:
        for bs in sizes:
            for ctx in ctxs:
                for overlap in (False, True):
                    host, wall = measure(lambda d=dev_ms: FakeDeviceRunner(d), bs, ctx, overlap,
                                         args.steps, args.repeats)
                    ratio = wall / dev_ms
                    if overlap:
                        worst = max(worst, ratio)
                    if bs == 256 and ctx == 32768:  # the worst of the runs
                        host_256x32k = host if host_256x32k != host_256x32k else max(
                            host_256x32k, host)
                    print(f"{f'fake {dev_ms:g} ms':<18}{bs:>5}{ctx:>7}  {overlap!s:<8}"
                          f"{host:>9.3f}{wall:>9.3f}{ratio:>9.3f}", flush=True)
    if not args.no_fake:  # the host work alone, and a sampled batch (informational)
        ctx = max(ctxs)
        alone = [measure(lambda: FakeDeviceRunner(0.0), bs, ctx, True, args.steps,
                         args.repeats)[0] for bs in sizes]
        print(f"host work alone (stand-in at 0 ms: no wait before it), ctx {ctx}: " + "  ".join(
            f"bs {bs}: {h:.3f} ms" for bs, h in zip(sizes, alone, strict=True)))
        sampled = SamplingParams(max_new_tokens=1 << 20, temperature=0.7, top_p=0.9,
                                 ignore_eos=True)
        host, wall = measure(lambda: FakeDeviceRunner(2.0), max(sizes), ctx, True, args.steps,
                             args.repeats, sampled)
        print(f"sampled batch (temperature 0.7, top_p 0.9; the sampler's math counts as host "
              f"here), bs {max(sizes)} x {ctx} at 2 ms, overlap: host {host:.3f} ms, "
              f"step/dev {wall / 2.0:.3f}")
    if not args.no_fake:  # speculation on: what it adds to a plain, overlapped step
        from scripts.step_lib.spec_overlap import WARM_UP, measure_pair

        bs, ctx = 64, min(max(ctxs), 8192)
        pairs = [measure_pair(bs, ctx, 2.0, args.steps) for _ in range(max(args.repeats, 3))]
        sp = {k: statistics.median(on[k] for on, _ in pairs) for k in pairs[0][0]}
        worst = max(worst, sp["step_ms"] / 2.0)
        gain = statistics.median(ratio for _, ratio in pairs)
        print(f"speculation on (NGRAM K=8, after {WARM_UP} steps), bs {bs} x {ctx} at 2 ms, "
              f"overlap: host {sp['host_ms']:.3f} ms, step/dev {sp['step_ms'] / 2.0:.3f} (mean "
              f"{sp['step_mean_ms'] / 2.0:.3f}), {sp['verify_steps']:.0f} verify steps of "
              f"{sp['policy_steps']:.0f}, {sp['tokens_per_step']:.1f} tokens a step ({bs} "
              f"without): {gain:.2f} x the tokens per second of the same steps without "
              f"speculation (median of {len(pairs)} pairs)", flush=True)
    if not args.no_fake:
        bs, ctx = max(sizes), min(max(ctxs), 8192)
        off, on, diff = measure_kv_events(bs, ctx, args.steps, max(args.repeats, 5))
        print(f"kv events (16 pages stored and 16 evicted per step, publisher + "
              f"subscriber running), bs {bs} x {ctx} at 2 ms, overlap: host off {off:.3f} ms, on "
              f"{on:.3f} ms ({(on / off - 1) * 100:+.1f} %; per step on - off: "
              f"{diff * 1e3:+.1f} us, {diff / off * 100:+.1f} %)", flush=True)
    if not args.no_real_model:
        for bs in sizes:
            for ctx in ctxs:
                runner = real_runner(bs, ctx, args.real_budget_mib << 20)
                if runner is None:
                    print(f"{'cpu model':<18}{bs:>5}{ctx:>7}  skipped: past the model's "
                          "context or the pool budget")
                    continue
                host, wall = measure(lambda r=runner: r, bs, ctx, False, args.real_steps)
                print(f"{'cpu model':<18}{bs:>5}{ctx:>7}  {'False':<8}{host:>9.3f}{wall:>9.3f}"
                      f"{'':>9}", flush=True)
    print(f"bench_step: host_ms_256x32k={host_256x32k:.3f} overlap_ratio_max={worst:.3f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
