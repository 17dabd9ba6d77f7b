"""The prefill peer's compute thread loop, shared by both protocols' peers."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Pipeline(Protocol):
    """What the loop needs of a push pipeline (`PushPipeline`, `SglangPushPipeline`)."""

    def is_busy(self) -> bool: ...

    def reap(self, now: float) -> None: ...


def run_compute_loop(stop: threading.Event, jobs: queue.Queue[T] | queue.Queue[T | None],
                     push: Pipeline,
                     start: Callable[[T], None], sweep: Callable[[float], None]) -> None:
    """Until `stop`: take the next job (a None job only wakes the loop), prefill it and post its
    WRITEs with `start`, and while they fly take the next; `push.reap` frees a job's pages only
    once its WRITEs settled; `sweep` expires what waited too long. At the end, let posted WRITEs
    land before memory goes away."""
    while not stop.is_set():
        try:
            job = jobs.get(timeout=0.0005 if push.is_busy() else 0.2)
        except queue.Empty:
            job = None
        if job is not None:
            start(job)
        push.reap(time.monotonic())
        sweep(time.monotonic())
    drain(push, timeout_s=10.0)


def drain(push: Pipeline, timeout_s: float) -> None:
    """Reap until nothing is in flight (or `timeout_s` passed): before memory goes away."""
    deadline = time.monotonic() + timeout_s
    while push.is_busy() and time.monotonic() < deadline:
        push.reap(time.monotonic())
        time.sleep(0.001)
