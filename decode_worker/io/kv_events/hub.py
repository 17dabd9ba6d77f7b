"""The one KV-event log of a worker and its subscriptions (ZMQ sender thread, in-process gRPC).

The compute thread ends each step with `KvEventHub.publish_step(tree)`: the tree's events of that
step become one `KvEventBatch` with the next sequence number (from 0 at process start, as
SGLang's publisher), appended to a ring of the last `buffer_steps` batches. Nothing here blocks
or hashes on the compute thread: the events only name their pages (`radix_events`), appending
is O(1) under a short lock, a waiting thread is notified only when one waits, and an async
subscriber gets at most one `call_soon_threadsafe` until it has run (not one per step).

Subscribers read the same log with their own cursor (`subscribe`): replay from a sequence number
while it is still buffered; a subscriber that is new, asks for a sequence that is gone, or falls
more than `buffer_steps` behind gets a `KvSnapshot` instead (every page of the tree, taken on the
compute thread at a step boundary, so it is exactly the state after batch `seq`), then the
batches after it. A ZMQ-style subscription (`snapshots=False`) skips lost batches and counts
them instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from decode_worker.core.radix_events import BlockStored, KVEvent


class EventSource(Protocol):
    """What the hub reads from the tree (`UnifiedRadixTree`), on the compute thread only."""

    def take_events(self) -> list[KVEvent]: ...

    def snapshot_events(self) -> list[BlockStored]: ...


@dataclass(slots=True)  # not frozen: built once per step, and frozen init costs 4x
class KvEventBatch:
    """One step's events: `seq` (u64 from 0), wall time `ts`, the publisher's DP rank, and
    `at`, the monotonic time of its append (0: unknown), from which senders measure their lag.
    Never changed once appended."""

    seq: int
    ts: float
    events: list[KVEvent]
    dp_rank: int = 0
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """Every page the tree held after batch `seq` (-1: before any batch), as stores (parents
    first). A subscriber that receives it drops what it held, applies these, and continues
    with batch `seq + 1`."""

    seq: int
    ts: float
    events: list[BlockStored]
    dp_rank: int = 0


Item = KvEventBatch | KvSnapshot


class KvEventHub:
    """The log (see module docstring). `publish_step` on the compute thread; everything else
    from any thread or event loop."""

    def __init__(self, buffer_steps: int = 10_000, dp_rank: int = 0,
                 load: Callable[[], Any] | None = None) -> None:
        self.dp_rank = dp_rank
        self._load = load
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ring: deque[KvEventBatch] = deque(maxlen=max(1, buffer_steps))
        self._next_seq = 0
        self._snapshot: KvSnapshot | None = None
        self._snap_gen = 0  # generation of `_snapshot`
        self._snap_wanted = 0  # highest generation a subscriber waits for
        self._subs: set[KvSubscription] = set()
        self._async_subs: tuple[KvSubscription, ...] = ()  # those awaited on an event loop
        self._num_waiting = 0  # threads in `KvSubscription.get`'s wait (under the lock)
        self.num_events_total = 0
        self.num_batches_total = 0

    # -- compute thread --------------------------------------------------------------------
    def publish_step(self, tree: EventSource) -> KvEventBatch | None:
        """Append the tree's events of this step as one batch (none when it recorded nothing),
        then build a snapshot if a subscriber asked for one. Compute thread only."""
        events = tree.take_events()
        batch = self.append(events) if events else None
        if self._snap_wanted > self._snap_gen:
            snap = tree.snapshot_events()
            with self._lock:
                self._snapshot = KvSnapshot(self._next_seq - 1, time.time(), snap, self.dp_rank)
                self._snap_gen += 1
                self._cond.notify_all()
            self._wake()
        return batch

    def append(self, events: list[KVEvent]) -> KvEventBatch:
        """Append one batch; returns it. The caller owns the ordering (one appending thread,
        the only writer of `_next_seq`)."""
        batch = KvEventBatch(self._next_seq, time.time(), events, self.dp_rank, time.monotonic())
        with self._lock:
            self._next_seq += 1
            self._ring.append(batch)
            self.num_batches_total += 1
            self.num_events_total += len(events)
            if self._num_waiting:
                self._cond.notify_all()
        self._wake()
        return batch

    def _wake(self) -> None:
        for sub in self._async_subs:  # a tuple, replaced (never mutated) under the lock
            sub._notify()

    # -- any thread ---------------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        """Sequence number the next batch gets."""
        with self._lock:
            return self._next_seq

    def replay(self, start_seq: int) -> list[KvEventBatch]:
        """The buffered batches with seq >= `start_seq`, oldest first (for the replay socket)."""
        with self._lock:
            return [b for b in self._ring if b.seq >= start_seq]

    def load(self) -> Any:
        """The worker's latest published load record (`io.api.backend.Load`), or None."""
        return self._load() if self._load is not None else None

    def subscribe(self, start_seq: int | None = None, *, snapshots: bool = True) -> KvSubscription:
        """A cursor on the log. `start_seq` None: a snapshot first, then live batches. An int:
        replay from it while buffered (else a snapshot, or with `snapshots=False` the oldest
        buffered batch and the skipped ones counted). Close it when done."""
        sub = KvSubscription(self, start_seq, snapshots)
        with self._lock:
            self._subs.add(sub)
        return sub

    def _next(self, sub: KvSubscription) -> Item | None:
        """The subscriber's next item if one is ready (lock held by the caller)."""
        if sub._want_gen:
            snap = self._snapshot
            if snap is None or self._snap_gen < sub._want_gen:
                return None
            sub._want_gen, sub.cursor = 0, snap.seq + 1
            return snap
        first = self._ring[0].seq if self._ring else self._next_seq
        cursor = sub.cursor
        if cursor is None or cursor > self._next_seq or cursor < first:
            if sub.snapshots or cursor is None:
                if not sub.snapshots:  # live from now, nothing to replay
                    sub.cursor = self._next_seq
                    return None
                snap = self._snapshot
                if snap is not None and snap.seq == self._next_seq - 1:  # still current
                    sub.cursor = self._next_seq
                    return snap
                sub._want_gen = self._snap_gen + 1
                self._snap_wanted = max(self._snap_wanted, sub._want_gen)
                return None
            sub.num_skipped_batches += first - cursor if cursor < first else 0
            sub.cursor = cursor = first if cursor < first else self._next_seq
        if cursor >= self._next_seq:
            return None
        sub.cursor = cursor + 1
        return self._ring[cursor - first]


class KvSubscription:
    """One subscriber's cursor. `get(timeout)` for threads, `await next()` on an event loop
    (the loop it is first awaited on). Items come in order; never two at once."""

    def __init__(self, hub: KvEventHub, start_seq: int | None, snapshots: bool) -> None:
        self.hub = hub
        self.cursor = start_seq
        self.snapshots = snapshots
        self.num_skipped_batches = 0
        self.closed = False
        self._want_gen = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._wake_pending = False

    def get(self, timeout: float | None = None) -> Item | None:
        """The next item, waiting up to `timeout` seconds; None on timeout or once closed."""
        hub = self.hub
        deadline = None if timeout is None else time.monotonic() + timeout
        with hub._cond:
            while not self.closed:
                item = hub._next(self)
                if item is not None:
                    return item
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                hub._num_waiting += 1
                try:
                    hub._cond.wait(left)
                finally:
                    hub._num_waiting -= 1
        return None

    def poll(self) -> Item | None:
        """The next item if one is ready, else None (never waits)."""
        with self.hub._lock:
            return None if self.closed else self.hub._next(self)

    async def next(self) -> Item:
        """The next item (waits on the running loop without blocking it). Raises
        `asyncio.CancelledError` when cancelled, `EOFError` once closed."""
        if self._event is None:
            self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
            hub = self.hub
            with hub._lock:
                if not self.closed:
                    hub._async_subs = (*hub._async_subs, self)
        while True:
            self._event.clear()
            item = self.poll()
            if item is not None:
                return item
            if self.closed:
                raise EOFError("KV event subscription closed")
            await self._event.wait()

    def close(self) -> None:
        """Stop: pending waits return (None / EOFError); the hub forgets the subscriber."""
        hub = self.hub
        with hub._cond:
            self.closed = True
            hub._subs.discard(self)
            hub._async_subs = tuple(s for s in hub._async_subs if s is not self)
            hub._cond.notify_all()
        self._wake_pending = False
        self._notify()

    def _notify(self) -> None:
        """Wake the awaiting loop, once until it ran: the callback clears the mark before it
        sets the event, so a batch appended after the clear schedules a new wake."""
        if self._loop is not None and not self._wake_pending:
            self._wake_pending = True
            try:
                self._loop.call_soon_threadsafe(self._on_wake)
            except RuntimeError:  # the subscriber's loop is closed
                self._wake_pending = False

    def _on_wake(self) -> None:
        self._wake_pending = False
        if self._event is not None:
            self._event.set()
