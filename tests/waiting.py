"""Bounded waiting for tests: poll a condition until it holds or the time is up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(cond: Callable[[], object], timeout: float = 3.0, what: str = "condition") -> None:
    """Return once `cond()` is truthy; raise AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not met in {timeout}s")


def timed_unreachable_answer(send: Callable[[], Any], name: str, limit_s: float) -> float:
    """`send()` a request to a decode worker whose prefill peer is down: it must be answered
    502 `peer_dead` saying the peer is unreachable within `limit_s`; returns the seconds."""
    start = time.monotonic()
    resp = send()
    took = time.monotonic() - start
    assert resp.status_code == 502, f"{name}: {resp.text[:2000]}"
    error = resp.json()["error"]
    assert error["reason"] == "peer_dead" and "unreachable" in error["message"], error
    assert took < limit_s, f"{name}: answered in {took:.2f} s"
    print(f"\n[down] peer_protocol={name}: peer_dead answer in {took:.3f} s")
    return took
