"""bench_step's speculation row: the decode step with speculative decoding on, over the
stand-in device, so that what speculation adds to a plain, overlapped step (the policy's
bookkeeping, the drafter's indexing during the forward, the drafting attempts that break
overlap) shows against the device time, as the rest of bench_step does.

The stand-in's tokens (a function of the token, position and page) repeat now and then, so
some drafts hold and most fail. Its device time does not grow with a step's entries; the cost
table the policy starts from says a verify step of 1 + K entries a request costs 1.5 x a plain
one at a full batch (a GPU at small batch), and the policy learns the host's share as it runs."""

from __future__ import annotations

import statistics
import time

from decode_worker.core.spec.drafter import SpecParams, make_drafter
from decode_worker.daemon.decode.speculate import Speculator, StepCost
from tests.fakes.fake_device import FakeDeviceRunner, running_stepper

K = 8
WARM_UP = 130  # steps: the first drafting attempts after 1, 2, 4, ... 64 plain steps


def measure_spec(bs: int, ctx: int, dev_ms: float, steps: int) -> dict[str, float]:
    """Host ms (median), step ms (median and mean) per step with NGRAM K = 8 on, how many
    steps drafted and verified, and the tokens a step committed (bs without speculation)."""
    runner = FakeDeviceRunner(dev_ms, lookahead=K)
    s = dev_ms / 1e3
    cost = StepCost([(1, s), (bs, s)], verify=[(1, s), (bs * (1 + K), 1.5 * s)])
    spec = Speculator(make_drafter(SpecParams("NGRAM", K)), K, cost)
    stepper = running_stepper(runner, bs, ctx, True, spec=spec)
    for _ in range(WARM_UP):  # rows written, the pipeline full, the policy's backoff grown
        stepper.step(time.monotonic())
    hosts, walls = [], []
    verifies0, steps0 = spec.stats.verify_steps_total, spec._step
    tokens0 = stepper.generated_tokens_total
    for _ in range(steps):
        runner.wait_s = runner.wait_cpu_s = runner.compute_cpu_s = 0.0
        t0, cpu0 = time.perf_counter(), time.thread_time()
        stepper.step(time.monotonic())
        stepper.table.outbox.flush()
        walls.append((time.perf_counter() - t0) * 1e3)
        device_cpu = runner.wait_cpu_s + runner.compute_cpu_s
        hosts.append((time.thread_time() - cpu0 - device_cpu) * 1e3)
    if stepper.busy:
        stepper.step(time.monotonic())
    return {"host_ms": statistics.median(hosts), "step_ms": statistics.median(walls),
            "step_mean_ms": statistics.fmean(walls),
            "verify_steps": spec.stats.verify_steps_total - verifies0,
            "policy_steps": spec._step - steps0,
            "tokens_per_step": (stepper.generated_tokens_total - tokens0) / steps}
