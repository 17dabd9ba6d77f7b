"""Bounded waiting for tests: poll a condition until it holds or the time is up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar


def wait_for(cond: Callable[[], object], timeout: float = 3.0, what: str = "condition") -> None:
    """Return once `cond()` is truthy; raise AssertionError after `timeout` seconds."""
    wait_value(lambda: True if cond() else None, timeout, what, poll_s=0.02)


T = TypeVar("T")


def wait_value(fn: Callable[[], T | None], timeout: float = 3.0, what: str = "a value",
               poll_s: float = 0.01) -> T:
    """The first value of `fn()` that is not None; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := fn()) is not None:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what} not met in {timeout}s")


class TransferEventLike(Protocol):
    @property
    def transfer_id(self) -> int: ...
    @property
    def kind(self) -> str: ...


E = TypeVar("E", bound=TransferEventLike)


def wait_transfer(poll: Callable[[], list[E]], seen: list[E], tid: int, kind: str,
                  timeout_s: float) -> list[E]:
    """Poll a KV receiver (`poll`) until transfer `tid` has an event of `kind`; returns that
    transfer's events so far. Events of other transfers polled meanwhile stay in `seen` (the
    caller's list, kept across calls) until their own wait asks for them."""
    got: list[E] = []

    def arrived() -> list[E] | None:
        seen.extend(poll())
        got.extend(e for e in seen if e.transfer_id == tid)
        seen[:] = [e for e in seen if e.transfer_id != tid]
        return got if any(e.kind == kind for e in got) else None

    try:
        return wait_value(arrived, timeout_s, f"transfer {tid}: a {kind!r} event", poll_s=0.002)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; got {got}") from None


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
