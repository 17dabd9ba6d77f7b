"""`SubscribeKvEvents`: the decode tree's KV events from the worker's one event log.

The stream reads the same `KvEventHub` the ZMQ publisher sends from (`io/kv_events/hub.py`),
with its own cursor, and turns its items into smg-grpc-proto's messages as smg 1.13 reads them:
- `start_sequence_number` 0 (a new subscriber) starts with a snapshot of the tree; N > 0
  replays from batch N while the log still holds it; a cursor the log no longer holds (too
  old, or from before a restart) and a subscriber that falls more than the log's length
  behind get a fresh snapshot. A snapshot is sent as `KvSnapshotChunk`s whose sequence
  numbers end at the batch the state was taken after; chunk 0 begins with a `cleared`
  event, then every cached page as a store, parents first. A snapshot of a tree that has
  published nothing yet (before batch 0) is empty and is not sent.
- each `BlockStored` of k pages becomes k `KvBlock`s (token ids sliced at i * block_size);
  hashes are the tree's SGLang page-chain hashes (signed int64).
- every batch carries the worker's `EngineLoad` (the GetLoads figures); while the log is
  quiet a `load_only` batch repeating the last sequence number goes out every
  `HEARTBEAT_S` (before the first batch only when the subscriber asked for
  `load_records_before_first_batch`, numbered 0).
Cancelling the call closes the subscription.

`StreamBook` keeps what each live stream has handed to gRPC: a `Generate` answer waits
(`wait_sent`, bounded) until every stream has handed over the batches appended before it, so on
one HTTP/2 connection (smg's channel to the worker) a request's KV events arrive before its
answer. `decode_worker_kv_event_lag_seconds{transport="grpc"}` is each batch's time from its
append to its handover.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from smg_grpc_proto.generated import common_pb2 as cpb

from decode_worker.core.radix_events import AllBlocksCleared, BlockRemoved, BlockStored
from decode_worker.io.api.loads import load_row
from decode_worker.io.kv_events.gate import MAX_HOLD_S
from decode_worker.io.kv_events.hub import KvEventHub, KvSnapshot
from decode_worker.io.metrics import Metrics

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
SNAPSHOT_CHUNK_EVENTS = 512  # stores per snapshot chunk (keeps each message small)
_TIERS = {"GPU": cpb.KV_CACHE_TIER_DEVICE, "CPU_PINNED": cpb.KV_CACHE_TIER_HOST,
          "DISK": cpb.KV_CACHE_TIER_DISK}
_LEVELS = {"GPU": 0, "CPU_PINNED": 1, "DISK": 2}


def event_message(event: Any) -> cpb.KvCacheEvent:
    """One tree event as smg's `KvCacheEvent` (event_id 0: the proto's synthesized id)."""
    if isinstance(event, BlockStored):
        size = event.block_size
        blocks = [cpb.KvBlock(block_hash=h, token_ids=event.token_ids[i * size:(i + 1) * size],
                              block_size=size, cache_level=_LEVELS.get(event.medium, 0))
                  for i, h in enumerate(event.block_hashes)]
        stored = cpb.KvBlocksStored(blocks=blocks, medium=event.medium,
                                    tier=_TIERS.get(event.medium, cpb.KV_CACHE_TIER_UNSPECIFIED))
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return cpb.KvCacheEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        return cpb.KvCacheEvent(removed=cpb.KvBlocksRemoved(
            block_hashes=list(event.block_hashes), medium=event.medium,
            cache_level=_LEVELS.get(event.medium, 0)))
    if isinstance(event, AllBlocksCleared):
        return cpb.KvCacheEvent(cleared=cpb.KvCacheCleared())
    raise TypeError(f"unknown KV event {type(event).__name__}")


def snapshot_chunks(snap: KvSnapshot) -> list[cpb.KvEventBatch]:
    """The snapshot as chunks numbered up to `snap.seq` (none when `snap.seq` < 0)."""
    if snap.seq < 0:
        return []
    stores = [event_message(e) for e in snap.events]
    wanted = max(1, -(-len(stores) // SNAPSHOT_CHUNK_EVENTS))
    count = min(wanted, snap.seq + 1)  # sequence numbers cannot go below 0
    per = -(-len(stores) // count) if stores else 0
    blocks = sum(len(e.block_hashes) for e in snap.events)
    out = []
    for i in range(count):
        events = stores[i * per:(i + 1) * per] if per else []
        if i == 0:
            events = [cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()), *events]
        out.append(cpb.KvEventBatch(
            sequence_number=snap.seq - (count - 1) + i, timestamp=snap.ts, events=events,
            dp_rank=snap.dp_rank, snapshot=cpb.KvSnapshotChunk(
                index=i, count=count, blocks=blocks, unknown_before=0)))
    return out


class LoadRecords:
    """The `EngineLoad` records of one stream (`sample` counts up per record)."""

    def __init__(self, hub: KvEventHub, server_info: Callable[[], dict[str, Any]]) -> None:
        self.hub, self.server_info, self.sample = hub, server_info, 0

    def record(self, load_only: bool) -> cpb.EngineLoad | None:
        load = self.hub.load()
        if load is None:
            return None
        info = self.server_info()
        row = load_row(load, info, str(info.get("disaggregation_mode") or "decode"))
        self.sample += 1
        return cpb.EngineLoad(
            running_requests=row["num_running_reqs"], waiting_requests=row["num_waiting_reqs"],
            waiting_uncached_tokens=row["num_waiting_uncached_tokens"],
            token_usage=row["token_usage"], max_running_requests=row["max_running_requests"],
            sample=self.sample, load_only=load_only, cache_hit_rate=row["cache_hit_rate"],
            num_used_tokens=row["num_used_tokens"],
            max_total_num_tokens=row["max_total_num_tokens"])


class StreamBook:
    """The live streams of one servicer and the next sequence number each has handed to gRPC
    (see the module docstring). Event loop only."""

    def __init__(self, metrics: Metrics | None = None, max_wait_s: float = MAX_HOLD_S) -> None:
        self.metrics, self.max_wait_s = metrics, max_wait_s
        self._sent: dict[int, int] = {}  # stream -> next seq not handed over (once it sent)
        self._keys = itertools.count()
        self._changed: asyncio.Event | None = None
        self.num_overdue = 0  # answers that stopped waiting for a stream after `max_wait_s`

    def open(self) -> int:
        """A new stream's key (it counts once it has handed over its first batch)."""
        return next(self._keys)

    def sent(self, key: int, next_seq: int, appended_at: float = 0.0) -> None:
        """Stream `key` handed over every batch below `next_seq` (the last appended at
        monotonic `appended_at`, 0: a snapshot)."""
        self._sent[key] = next_seq
        if appended_at and self.metrics is not None:
            self.metrics.observe_kv_event_lag("grpc", time.monotonic() - appended_at)
        self._wake()

    def close(self, key: int) -> None:
        self._sent.pop(key, None)
        self._wake()

    async def wait_sent(self, need: int) -> None:
        """Until every stream has handed over the batches below `need`, or `max_wait_s`."""
        deadline = time.monotonic() + self.max_wait_s
        while any(sent < need for sent in self._sent.values()):
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                self.num_overdue += 1
                log.warning("an answer waited %.2fs for a SubscribeKvEvents stream to take "
                            "batch %d: sent without it", self.max_wait_s, need - 1)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()


async def kv_batches(hub: KvEventHub, request: cpb.SubscribeKvEventsRequest,
                     server_info: Callable[[], dict[str, Any]],
                     book: StreamBook | None = None) -> AsyncIterator[cpb.KvEventBatch]:
    """The stream of one subscriber (see the module docstring); closes its subscription when
    the consumer stops. Reports what it handed over to `book`."""
    start = request.start_sequence_number or None
    sub = hub.subscribe(start)
    loads = LoadRecords(hub, server_info)
    last: int | None = None  # the last sequence number sent
    book = book or StreamBook()
    key = book.open()
    try:
        while True:
            try:
                item = await asyncio.wait_for(sub.next(), HEARTBEAT_S)
            except TimeoutError:
                if last is not None or request.load_records_before_first_batch:
                    yield cpb.KvEventBatch(sequence_number=last or 0, dp_rank=hub.dp_rank,
                                           load=loads.record(load_only=True))
                continue
            if isinstance(item, KvSnapshot):
                for chunk in snapshot_chunks(item):
                    chunk.load.CopyFrom(loads.record(load_only=False) or cpb.EngineLoad())
                    last = chunk.sequence_number
                    yield chunk
                book.sent(key, item.seq + 1)
                continue
            batch = cpb.KvEventBatch(
                sequence_number=item.seq, timestamp=item.ts, dp_rank=item.dp_rank,
                events=[event_message(e) for e in item.events])
            record = loads.record(load_only=False)
            if record is not None:
                batch.load.CopyFrom(record)
            last = item.seq
            yield batch
            book.sent(key, item.seq + 1, item.at)
    finally:
        book.close(key)
        sub.close()
