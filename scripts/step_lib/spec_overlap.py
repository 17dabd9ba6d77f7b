"""bench_step's speculation row: the decode step with speculative decoding on, over the
stand-in device, so that what speculation adds to a plain, overlapped step (the policy's
bookkeeping, the drafter's indexing during the forward, the drafting attempts that break
overlap) shows against the device time, as the rest of bench_step does.

The stand-in's tokens (a function of the token, position and page) repeat now and then, so
some drafts hold and most fail. Its device time does not grow with a step's entries; the cost
table the policy starts from says a step of bs x (1 + K) entries costs 1.5 x one of bs (a GPU
at small batch), and the policy learns the host's share as it runs.

The peer is the same steps without speculation, run right before (`measure_pair`): the
stand-in's own steps on this host average above its device time (preemption, the collector), so
the figure is the ratio of the two runs' tokens per second, not one run against 2 ms."""

from __future__ import annotations

import statistics

from decode_worker.core.spec.drafter import SpecParams, make_drafter
from decode_worker.daemon.decode.speculate import Speculator, StepCost
from scripts.step_lib.timing import timed_steps
from tests.fakes.fake_device import FakeDeviceRunner, running_stepper

K = 8
WARM_UP = 130  # steps: the first drafting attempts after 1, 2, 4, ... 64 plain steps


def measure_spec(bs: int, ctx: int, dev_ms: float, steps: int, *, spec_on: bool = True
                 ) -> dict[str, float]:
    """Host ms (median), step ms (median and mean) per step, with NGRAM K = 8 on (or off:
    the peer), how many steps drafted and verified, the tokens a step committed (bs without
    speculation) and the tokens per second over the timed steps."""
    runner = FakeDeviceRunner(dev_ms, lookahead=K)
    s = dev_ms / 1e3
    full = [(1, s), (bs, s), (bs * (1 + K), 1.5 * s)]  # a step of any bs * (1 + K) entries
    spec = (Speculator(make_drafter(SpecParams("NGRAM", K)), K, StepCost(full, verify=full))
            if spec_on else None)
    stepper = running_stepper(runner, bs, ctx, True, spec=spec)
    timed_steps(stepper, runner, WARM_UP, 0)  # rows written, the backoff grown
    verifies0 = spec.stats.verify_steps_total if spec else 0
    steps0 = spec._step if spec else 0
    tokens0 = stepper.generated_tokens_total
    hosts, walls = timed_steps(stepper, runner, 0, steps)
    tokens = stepper.generated_tokens_total - tokens0
    return {"host_ms": statistics.median(hosts), "step_ms": statistics.median(walls),
            "step_mean_ms": statistics.fmean(walls),
            "verify_steps": spec.stats.verify_steps_total - verifies0 if spec else 0,
            "policy_steps": spec._step - steps0 if spec else 0,
            "tokens_per_step": tokens / steps, "tokens_per_s": tokens / sum(walls) * 1e3}


def measure_pair(bs: int, ctx: int, dev_ms: float, steps: int
                 ) -> tuple[dict[str, float], float]:
    """The speculation run (`measure_spec`) and its tokens per second over those of the same
    steps without speculation, run just before it."""
    off = measure_spec(bs, ctx, dev_ms, steps, spec_on=False)
    on = measure_spec(bs, ctx, dev_ms, steps)
    return on, on["tokens_per_s"] / off["tokens_per_s"]
