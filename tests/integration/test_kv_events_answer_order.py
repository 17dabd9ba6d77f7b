"""The engine's outbox behind the real ZMQ publisher (loopback): a step's answer reaches the event
loop only after the publisher put that step's KV-event batch on the socket, even while the
publisher's thread is held up; tokens without an answer are not held; the publish lag is in
`decode_worker_kv_event_lag_seconds{transport="zmq"}`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import zmq

from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.daemon.decode.bridge import Ended, Event, Outbox, StepTokens
from decode_worker.io.kv_events.hub import KvEventBatch, KvEventHub
from decode_worker.io.kv_events.publisher import ZmqKvEventPublisher
from decode_worker.io.metrics import Metrics
from decode_worker.settings.kv_events import parse_kv_events_config
from tests.waiting import wait_for

PS = 4


class Held:
    """A publisher whose sends wait until the test lets them go (a starved sender thread)."""

    def __init__(self, pub: ZmqKvEventPublisher) -> None:
        self.go = threading.Event()
        self.send = pub._send
        pub._send = self._send  # type: ignore[method-assign]

    def _send(self, batch: KvEventBatch) -> None:
        assert self.go.wait(30), "the test never released the sender"
        self.send(batch)


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_an_answer_reaches_the_loop_only_after_its_steps_events_are_sent(
        loop: asyncio.AbstractEventLoop) -> None:
    cfg = parse_kv_events_config({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})
    tree = UnifiedRadixTree(PS, 7, PageAllocator(64, "full"), None, kv_events=True)
    hub, metrics = KvEventHub(cfg.buffer_steps), Metrics()
    pub = ZmqKvEventPublisher.bind(cfg, metrics)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        held = Held(pub)
        pub.start(hub)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        wait_for(lambda: pub.num_subscriptions > 0, 10, "the subscription")
        sent_at_delivery: list[tuple[str, int]] = []

        def deliver(events: list[Event]) -> None:  # on the loop, as the backend's
            sent_at_delivery.extend((type(e).__name__, pub.num_published_batches)
                                    for e in events)

        assert pub.gate is not None
        outbox = Outbox(loop, deliver, gate=pub.gate)
        # one engine step: the request's KV enters the tree, the step's events are appended,
        # then its answer is flushed
        tree.insert(list(range(8)), tree.full.alloc(2), [], 0)
        hub.publish_step(tree)
        outbox.put(StepTokens(["a"], [7]))
        outbox.put(Ended("a", "stop"))
        outbox.flush()
        outbox.put(StepTokens(["b"], [8]))  # the next step: behind the held answer
        outbox.flush()
        assert pub.gate.num_waiting == 2 and sent_at_delivery == []
        held.go.set()  # the sender thread runs: the batch goes out, then the answer
        wait_for(lambda: len(sent_at_delivery) == 3, 10, "the answer")
        assert sent_at_delivery == [("StepTokens", 1), ("Ended", 1), ("StepTokens", 1)]
        assert sub.poll(10_000) and int.from_bytes(sub.recv_multipart()[1], "big") == 0
        outbox.put(StepTokens(["b"], [9]))  # no answer, nothing waits: at once
        outbox.flush()
        wait_for(lambda: len(sent_at_delivery) == 4, 10, "the tokens")
        text = metrics.exposition()[0].decode()
        assert 'decode_worker_kv_event_lag_seconds_count{transport="zmq"} 1.0' in text
        assert pub.gate.num_overdue == 0
    finally:
        sub.close()
        pub.close()
