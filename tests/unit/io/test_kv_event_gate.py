"""`AnswerGate`: a step's answers go to the event loop only once the ZMQ publisher has sent the
KV-event batches appended up to that step; later batches keep their order; the compute thread
never waits (a batch held too long goes anyway, counted); a stopped publisher holds nothing."""

from __future__ import annotations

import asyncio
import threading
import time

from decode_worker.core.radix_events import AllBlocksCleared
from decode_worker.daemon.decode.bridge import CacheFlushed, Ended, Outbox, StepTokens
from decode_worker.io.api.backend import FlushResult
from decode_worker.io.kv_events.gate import AnswerGate
from decode_worker.io.kv_events.hub import KvEventHub


def _gate(max_hold_s: float = 60.0) -> tuple[KvEventHub, AnswerGate, list[str]]:
    hub = KvEventHub(16)
    return hub, AnswerGate(hub, max_hold_s), []


def test_an_answer_waits_for_the_send_of_the_batches_before_it() -> None:
    hub, gate, out = _gate()
    gate.run_after(lambda: out.append("tokens"), final=False)  # nothing appended: goes
    hub.append([AllBlocksCleared()])  # batch 0
    gate.run_after(lambda: out.append("answer"), final=True)
    gate.run_after(lambda: out.append("later tokens"), final=False)  # behind the answer
    assert out == ["tokens"] and gate.num_waiting == 2
    gate.sent(1)
    assert out == ["tokens", "answer", "later tokens"] and gate.num_waiting == 0
    gate.run_after(lambda: out.append("answer 2"), final=True)  # batch 0 is out: at once
    assert out[-1] == "answer 2" and gate.num_held == 2 and gate.num_overdue == 0


def test_answers_leave_in_order_as_the_publisher_catches_up() -> None:
    hub, gate, out = _gate()
    for i in range(3):
        hub.append([AllBlocksCleared()])
        gate.run_after(lambda i=i: out.append(f"a{i}"), final=True)  # needs batches 0..i
    gate.sent(2)
    assert out == ["a0", "a1"]
    gate.sent(1)  # progress never goes back
    gate.sent(3)
    assert out == ["a0", "a1", "a2"]


def test_a_stalled_publisher_delays_an_answer_at_most_max_hold() -> None:
    hub, gate, out = _gate(max_hold_s=0.05)
    hub.append([AllBlocksCleared()])
    gate.run_after(lambda: out.append("answer"), final=True)
    gate.release_overdue()
    assert out == []
    deadline = time.monotonic() + 5
    while not out and time.monotonic() < deadline:  # the compute thread's next steps
        gate.release_overdue()
        time.sleep(0.01)
    assert out == ["answer"] and gate.num_overdue == 1


def test_a_stopped_publisher_releases_everything_and_holds_nothing_more() -> None:
    hub, gate, out = _gate()
    hub.append([AllBlocksCleared()])
    gate.run_after(lambda: out.append("held"), final=True)
    gate.open()
    hub.append([AllBlocksCleared()])
    gate.run_after(lambda: out.append("next"), final=True)
    assert out == ["held", "next"]


def test_the_outbox_holds_only_batches_with_an_answer_and_keeps_the_order() -> None:
    """Through the engine's `Outbox`: tokens go at once, a batch with `Ended` (or a flush's
    `CacheFlushed`) waits for the publisher, and the tokens of the next step wait behind it;
    the publisher's thread releases them onto the loop."""
    hub, gate, _ = _gate()
    loop = asyncio.new_event_loop()
    got: list[list[object]] = []
    outbox = Outbox(loop, got.append, gate=gate)
    try:
        outbox.put(StepTokens(["a"], [1]))
        outbox.flush()
        hub.append([AllBlocksCleared()])
        outbox.put(Ended("a", "stop"))
        outbox.flush()
        outbox.put(StepTokens(["b"], [2]))
        outbox.flush()
        hub.append([AllBlocksCleared()])
        outbox.put(CacheFlushed(1, FlushResult(True)))
        outbox.flush()
        loop.run_until_complete(asyncio.sleep(0))
        assert [type(b[0]).__name__ for b in got] == ["StepTokens"]
        publisher = threading.Thread(target=gate.sent, args=(2,))
        publisher.start()
        publisher.join()
        loop.run_until_complete(asyncio.sleep(0))
        assert [type(b[0]).__name__ for b in got] == ["StepTokens", "Ended", "StepTokens",
                                                      "CacheFlushed"]
    finally:
        loop.close()
