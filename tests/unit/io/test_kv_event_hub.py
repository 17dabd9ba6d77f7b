"""The KV-event log: one log, per-subscriber cursors, replay from a sequence number, snapshots
for subscribers that are new or fell behind, skipped batches counted for ZMQ-style readers."""

from __future__ import annotations

import asyncio
import threading

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.io.kv_events.hub import KvEventBatch, KvEventHub, KvSnapshot


def make_tree() -> UnifiedRadixTree:
    return UnifiedRadixTree(4, 7, PageAllocator(16, "full"), None, kv_events=True)


def store(tree: UnifiedRadixTree, toks: list[int]) -> None:
    need = len(toks) // 4
    if tree.full.num_free < need:
        tree.evict_full(need - tree.full.num_free)
    tree.insert(toks, tree.full.alloc(need), [], 0)


def test_replay_from_a_buffered_sequence_then_live() -> None:
    tree, hub = make_tree(), KvEventHub(buffer_steps=8)
    for i in range(3):
        store(tree, [i] * 8)
        hub.publish_step(tree)
    sub = hub.subscribe(1)
    got = [sub.poll(), sub.poll(), sub.poll()]
    assert [b.seq for b in got if isinstance(b, KvEventBatch)] == [1, 2]
    assert got[2] is None
    assert hub.publish_step(tree) is None  # a step without events sends no batch
    store(tree, [9] * 4)
    hub.publish_step(tree)
    item = sub.get(timeout=1.0)
    assert isinstance(item, KvEventBatch) and item.seq == 3


def test_new_or_lagging_subscriber_gets_a_snapshot_equal_to_the_log() -> None:
    tree, hub = make_tree(), KvEventHub(buffer_steps=2)
    live = KVEventIndex()
    reader = hub.subscribe(0)
    for i in range(6):  # 6 batches through a ring of 2, evicting (16 pages, 2 per insert)
        store(tree, [i, i + 1] * 4)
        batch = hub.publish_step(tree)
        assert batch is not None
        live.apply(batch.events)
    lagging = hub.subscribe(0)  # batch 0 is gone: a snapshot
    assert lagging.poll() is None
    hub.publish_step(tree)  # the compute thread's next step builds it
    snap = lagging.poll()
    assert isinstance(snap, KvSnapshot) and snap.seq == 5
    rebuilt = KVEventIndex()
    rebuilt.apply(snap.events)
    assert rebuilt.entries() == live.entries()
    assert reader.poll() is not None  # the first reader fell behind too: it gets one as well


def test_zmq_style_reader_skips_lost_batches_and_counts_them() -> None:
    tree, hub = make_tree(), KvEventHub(buffer_steps=2)
    sub = hub.subscribe(0, snapshots=False)
    for i in range(5):
        store(tree, [i] * 4)
        hub.publish_step(tree)
    item = sub.poll()
    assert isinstance(item, KvEventBatch) and item.seq == 3 and sub.num_skipped_batches == 3


def test_async_subscriber_wakes_on_a_batch_from_another_thread() -> None:
    tree, hub = make_tree(), KvEventHub()

    async def main() -> KvEventBatch | KvSnapshot:
        sub = hub.subscribe(0)
        t = threading.Thread(target=lambda: (store(tree, [1] * 4), hub.publish_step(tree)))
        t.start()
        item = await asyncio.wait_for(sub.next(), 5.0)
        t.join(5.0)
        sub.close()
        return item

    item = asyncio.run(main())
    assert isinstance(item, KvEventBatch) and item.seq == 0 and len(item.events) == 1


def test_async_subscriber_reads_every_batch_of_a_fast_appender_in_order() -> None:
    # the appender schedules one wake until the loop ran it: coalesced wakes lose no batch
    tree, hub = make_tree(), KvEventHub(buffer_steps=1000)
    num = 300

    def produce() -> None:
        for i in range(num):
            store(tree, [i % 5, i] * 2)
            hub.publish_step(tree)

    async def main() -> list[int]:
        sub = hub.subscribe(0)
        seqs: list[int] = []
        t = threading.Thread(target=produce)
        t.start()
        while len(seqs) < num:
            item = await asyncio.wait_for(sub.next(), 5.0)
            assert isinstance(item, KvEventBatch)
            seqs.append(item.seq)
        t.join(5.0)
        sub.close()
        return seqs

    assert asyncio.run(main()) == list(range(num))
