"""bench_step's speculation row: the decode step with speculative decoding on, over the
stand-in device, so that what speculation adds to a plain, overlapped step (the policy's
bookkeeping, the drafter's indexing during the forward, the drafting attempts that break
overlap) shows against the device time, as the rest of bench_step does.

The stand-in's tokens (a function of the token, position and page) repeat now and then, so
some drafts hold and most fail. Its device time does not grow with a step's entries; the cost
table the policy starts from says a step of bs x (1 + K) entries costs 1.5 x one of bs (a GPU
at small batch), and the policy learns the host's share as it runs."""

from __future__ import annotations

import statistics

from decode_worker.core.spec.drafter import SpecParams, make_drafter
from decode_worker.daemon.decode.speculate import Speculator, StepCost
from scripts.step_lib.timing import timed_steps
from tests.fakes.fake_device import FakeDeviceRunner, running_stepper

K = 8
WARM_UP = 130  # steps: the first drafting attempts after 1, 2, 4, ... 64 plain steps


def measure_spec(bs: int, ctx: int, dev_ms: float, steps: int) -> dict[str, float]:
    """Host ms (median), step ms (median and mean) per step with NGRAM K = 8 on, how many
    steps drafted and verified, and the tokens a step committed (bs without speculation)."""
    runner = FakeDeviceRunner(dev_ms, lookahead=K)
    s = dev_ms / 1e3
    full = [(1, s), (bs, s), (bs * (1 + K), 1.5 * s)]  # a step of any bs * (1 + K) entries
    cost = StepCost(full, verify=full)
    spec = Speculator(make_drafter(SpecParams("NGRAM", K)), K, cost)
    stepper = running_stepper(runner, bs, ctx, True, spec=spec)
    timed_steps(stepper, runner, WARM_UP, 0)  # rows written, the backoff grown
    verifies0, steps0 = spec.stats.verify_steps_total, spec._step
    tokens0 = stepper.generated_tokens_total
    hosts, walls = timed_steps(stepper, runner, 0, steps)
    return {"host_ms": statistics.median(hosts), "step_ms": statistics.median(walls),
            "step_mean_ms": statistics.fmean(walls),
            "verify_steps": spec.stats.verify_steps_total - verifies0,
            "policy_steps": spec._step - steps0,
            "tokens_per_step": (stepper.generated_tokens_total - tokens0) / steps}
