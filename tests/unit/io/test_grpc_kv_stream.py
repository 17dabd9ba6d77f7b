"""SubscribeKvEvents' stream on a real `KvEventHub`: a new subscriber's snapshot chunks, replay
from a sequence number, per-page blocks, load records and the cursor past a gap; answers wait
for the streams to hand their batches over (`StreamBook`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from smg_grpc_proto.generated import common_pb2 as cpb

from decode_worker.core.radix_events import BlockRemoved, BlockStored, KVEvent
from decode_worker.io.api.backend import Load
from decode_worker.io.grpc.kv_stream import StreamBook, kv_batches
from decode_worker.io.kv_events.hub import KvEventHub
from decode_worker.io.metrics import Metrics

INFO = {"disaggregation_mode": "decode", "max_total_num_tokens": 1000,
        "max_running_requests": 8}


class Tree:
    """The tree's side of the hub: events of the step, and its pages for a snapshot."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.pages: list[BlockStored] = []

    def take_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out

    def snapshot_events(self) -> list[BlockStored]:
        return list(self.pages)


def _store(hashes: list[int], parent: int | None) -> BlockStored:
    return BlockStored(hashes, parent, list(range(4 * len(hashes))), 4)


async def _take(hub: KvEventHub, tree: Tree, request: cpb.SubscribeKvEventsRequest,
                count: int) -> list[cpb.KvEventBatch]:
    stream = kv_batches(hub, request, lambda: INFO)
    out: list[cpb.KvEventBatch] = []
    try:
        while len(out) < count:
            task = asyncio.ensure_future(anext(stream))
            while not task.done():  # the compute thread's step boundary, played here
                hub.publish_step(tree)
                await asyncio.sleep(0.01)
            out.append(task.result())
    finally:
        await stream.aclose()
    return out


def _hub() -> tuple[KvEventHub, Tree]:
    hub = KvEventHub(buffer_steps=4, load=lambda: Load(num_running_reqs=2, num_used_tokens=250))
    tree = Tree()
    tree.events = [_store([11, 12], None)]
    hub.publish_step(tree)  # batch 0
    tree.events = [_store([13], 12)]
    hub.publish_step(tree)  # batch 1
    tree.pages = [_store([11, 12], None), _store([13], 12)]
    return hub, tree


def test_new_subscriber_gets_a_snapshot_then_live_batches() -> None:
    hub, tree = _hub()

    async def run() -> list[cpb.KvEventBatch]:
        async def later() -> None:
            await asyncio.sleep(0.05)
            tree.events = [BlockRemoved([13])]
        task = asyncio.ensure_future(later())
        out = await _take(hub, tree, cpb.SubscribeKvEventsRequest(), 2)
        await task
        return out

    snap, live = asyncio.run(run())
    assert snap.HasField("snapshot") and snap.snapshot.count == 1 and snap.snapshot.blocks == 3
    assert snap.sequence_number == 1  # the state after batch 1
    assert snap.events[0].HasField("cleared")
    stored = [b.block_hash for e in snap.events[1:] for b in e.stored.blocks]
    assert stored == [11, 12, 13]
    assert [list(b.token_ids) for b in snap.events[1].stored.blocks] == [[0, 1, 2, 3],
                                                                        [4, 5, 6, 7]]
    assert snap.events[2].stored.parent_block_hash == 12
    assert live.sequence_number == 2 and list(live.events[0].removed.block_hashes) == [13]
    assert live.load.running_requests == 2 and live.load.token_usage == 0.25


def test_replay_from_a_buffered_sequence_number_and_resnapshot_when_gone() -> None:
    hub, tree = _hub()
    replay = asyncio.run(_take(hub, tree, cpb.SubscribeKvEventsRequest(
        start_sequence_number=1), 1))
    assert replay[0].sequence_number == 1 and not replay[0].HasField("snapshot")
    assert [b.block_hash for b in replay[0].events[0].stored.blocks] == [13]
    for _ in range(6):  # the log keeps 4 batches: batch 1 is gone
        tree.events = [_store([99], None)]
        hub.publish_step(tree)
    gone = asyncio.run(_take(hub, tree, cpb.SubscribeKvEventsRequest(
        start_sequence_number=1), 1))
    assert gone[0].HasField("snapshot") and gone[0].sequence_number == 7


def test_a_quiet_log_sends_load_records(monkeypatch: Any) -> None:
    monkeypatch.setattr("decode_worker.io.grpc.kv_stream.HEARTBEAT_S", 0.02)
    hub = KvEventHub(buffer_steps=4, load=lambda: Load(num_waiting_reqs=1))
    tree = Tree()
    first = asyncio.run(_take(hub, tree, cpb.SubscribeKvEventsRequest(
        load_records_before_first_batch=True), 2))
    assert all(b.load.load_only and not b.events for b in first)
    assert first[0].sequence_number == 0 and first[1].load.sample > first[0].load.sample
    assert first[0].load.waiting_requests == 1


def test_an_answer_waits_until_every_stream_handed_over_its_batches() -> None:
    """`StreamBook.wait_sent(need)`: done once each live stream has handed gRPC the batches
    below `need` (a stream that sent nothing yet, or closed, does not count); a stream that
    stays behind holds an answer `max_wait_s` at most, counted."""

    async def run() -> None:
        book = StreamBook(Metrics(), max_wait_s=60.0)
        a, b, fresh = book.open(), book.open(), book.open()
        book.sent(a, 3)
        book.sent(b, 1)
        del fresh  # opened, nothing handed over yet: not waited for
        waiter = asyncio.ensure_future(book.wait_sent(3))
        await asyncio.sleep(0)
        assert not waiter.done()
        book.sent(b, 2)
        await asyncio.sleep(0)
        assert not waiter.done()
        book.close(b)  # the consumer left
        await asyncio.wait_for(waiter, 5)
        book.sent(a, 5, time.monotonic())
        await asyncio.wait_for(book.wait_sent(5), 5)
        text = book.metrics.exposition()[0].decode()  # type: ignore[union-attr]
        assert 'decode_worker_kv_event_lag_seconds_count{transport="grpc"} 1.0' in text
        slow = StreamBook(max_wait_s=0.05)
        slow.sent(slow.open(), 0)
        await asyncio.wait_for(slow.wait_sent(1), 5)
        assert slow.num_overdue == 1 and book.num_overdue == 0

    asyncio.run(run())
