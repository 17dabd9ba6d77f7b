"""Timing decode steps on the stand-in device (tests/fakes/fake_device.py)."""

from __future__ import annotations

import time
from typing import Any


def timed_steps(stepper: Any, runner: Any, warm_up: int, steps: int
                ) -> tuple[list[float], list[float]]:
    """Run `warm_up` steps, then time `steps` steps: (host ms, wall ms) per step. Host time
    is the compute thread's CPU time outside the (simulated) device, so a shared machine's
    preemption does not count as host work; the wall time is what the step lasted. The last
    launched step is committed after (outside the measurement)."""
    for _ in range(warm_up):
        stepper.step(time.monotonic())
    hosts, walls = [], []
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
    return hosts, walls
