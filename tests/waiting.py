"""Bounded waiting for tests: poll a condition until it holds or the time is up."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 3.0, what: str = "condition") -> None:
    """Return once `cond()` is truthy; raise AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not met in {timeout}s")
