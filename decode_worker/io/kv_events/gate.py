"""Answers after events: a final answer leaves only once the ZMQ publisher has sent the KV-event
batches of the steps up to it.

The compute thread appends a step's events to the log (`KvEventHub`) before it hands the step's
answers to the event loop, but the ZMQ publisher sends from its own thread: without a gate, an
answer could reach its client (and the client its next request reach a router) before the
events that say what the request left in the tree. So the engine hands each step's outbox batch
to `AnswerGate.run_after`: a batch that ends a request waits until the publisher has handled
(sent, or counted as dropped) every batch appended so far; a batch behind a waiting one waits
too (answers keep their order); any other goes at once. The publisher thread reports progress
with `sent(next_seq)` and releases what waits, in order. The compute thread never waits: a
batch held longer than `max_hold_s` (a publisher thread starved or stuck) is released by the
next step, counted in `num_overdue`, and logged; once the publisher stops (`open`) nothing is
held any more. In-process subscribers (gRPC) need no gate: the log wakes them on the event
loop before the step's answers are delivered there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from decode_worker.io.kv_events.hub import KvEventHub

log = logging.getLogger(__name__)
MAX_HOLD_S = 1.0  # an answer waits at most this long for the publisher


class AnswerGate:
    """See module docstring. `run_after` and `release_overdue` on the compute thread, `sent`
    and `open` on the publisher's thread; `fn`s run under the gate's lock, in order, so each
    must be quick and must not call back into the gate (`loop.call_soon_threadsafe`)."""

    def __init__(self, hub: KvEventHub, max_hold_s: float = MAX_HOLD_S) -> None:
        self.hub = hub
        self.max_hold_s = max_hold_s
        self._lock = threading.Lock()
        self._sent = hub.next_seq  # every batch below this one is handled
        self._held: deque[tuple[int, float, Callable[[], None]]] = deque()
        self._open = False
        self.num_held = 0  # batches that waited for the publisher
        self.num_overdue = 0  # ... and went out after `max_hold_s` without it

    def run_after(self, fn: Callable[[], None], *, final: bool) -> None:
        """Run `fn` (hand a step's outbox batch to the loop) now, or once the publisher has
        handled every batch appended so far (`final`: the batch ends a request) and every
        batch held before it has gone."""
        need = self.hub.next_seq if final else 0
        with self._lock:
            if not self._held and (self._open or self._sent >= need):
                fn()
                return
            self._held.append((need, time.monotonic(), fn))
            self.num_held += 1

    def sent(self, next_seq: int) -> None:
        """The publisher handled every batch below `next_seq`: release what waited for it."""
        with self._lock:
            self._sent = max(self._sent, next_seq)
            self._release(time.monotonic())

    def release_overdue(self) -> None:
        """Release the batches held longer than `max_hold_s` (compute thread, each step)."""
        if self._held:  # unlocked peek: a batch held meanwhile is seen next step
            with self._lock:
                self._release(time.monotonic())

    def open(self) -> None:
        """The publisher stopped: release everything, hold nothing from now on."""
        with self._lock:
            self._open = True
            self._release(time.monotonic())

    @property
    def num_waiting(self) -> int:
        """Batches held now."""
        with self._lock:
            return len(self._held)

    def _release(self, now: float) -> None:
        """Run the held `fn`s that may go, oldest first (lock held)."""
        held = self._held
        while held:
            need, since, fn = held[0]
            if not (self._open or self._sent >= need):
                if now - since < self.max_hold_s:
                    return
                self.num_overdue += 1
                log.warning("an answer waited %.2fs for the KV-event publisher (batch %d not "
                            "sent yet): sent without it", now - since, need - 1)
            held.popleft()
            fn()
