"""`scheduler.max_queued_requests` bounds the requests waiting to start (no token yet), not the
requests in flight: running ones do not count, so a bound below `max_running_requests` never
caps concurrency. And a refusal goes to the engine as one `RefuseRequest` naming its rooms."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.backend import DecodeBackend
from decode_worker.daemon.decode.bridge import (
    AddRequest,
    BackendInfo,
    Ended,
    Inbox,
    PromptTotals,
    RefuseRequest,
    Tokens,
)
from decode_worker.errors import QueueFull
from decode_worker.io.api.backend import GenerateInput, Load, OutputChunk
from decode_worker.io.api.targets import Target
from tests.examples import examples
from tests.fakes.fake_backend import ByteTokenizer

INFO = BackendInfo("/m", "m", 16, 127, 1024, 8, 64, 4096)
OPS = st.lists(st.tuples(st.sampled_from(["submit", "start", "end"]), st.integers(0, 50)),
               max_size=60)


def make(max_queued: int) -> tuple[DecodeBackend, Inbox]:
    inbox = Inbox()
    return DecodeBackend(inbox, ByteTokenizer(), INFO, max_queued, 8998,
                         loads=SimpleNamespace(load=Load())), inbox


async def play(max_queued: int, ops: list[tuple[str, int]]) -> int:
    """Run `ops` against a backend and a model of it; returns the most requests running."""
    backend, _ = make(max_queued)
    waiting: dict[str, Any] = {}  # rid -> (iterator, first __anext__ task)
    running: dict[str, Any] = {}
    most_running, n = 0, 0
    for op, k in ops:
        if op == "submit":
            n += 1
            rid = f"r{n}"
            it = backend.generate(GenerateInput(rid, [1, 2], SamplingParams(max_new_tokens=4)))
            task = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0)
            if len(waiting) >= max_queued:
                assert task.done() and isinstance(task.exception(), QueueFull)
            else:
                assert not task.done()
                waiting[rid] = (it, task)
        elif op == "start" and waiting:
            rid = sorted(waiting)[k % len(waiting)]
            backend.deliver([Tokens(rid, OutputChunk([7]), PromptTotals(2))])
            running[rid] = waiting.pop(rid)
            assert (await running[rid][1]).token_ids == [7]
        elif op == "end" and (waiting or running):
            pool = waiting if k % 2 and waiting else running or waiting
            rid = sorted(pool)[k % len(pool)]
            it, task = pool.pop(rid)
            backend.deliver([Ended(rid, "length")])
            await task if not task.done() else None
            await it.aclose()
        assert backend.num_queued == len(waiting) <= max_queued
        most_running = max(most_running, len(running))
    return most_running


@settings(max_examples=examples(60), deadline=None)
@given(max_queued=st.integers(1, 4), ops=OPS)
def test_the_bound_counts_only_requests_waiting_to_start(max_queued: int,
                                                         ops: list[tuple[str, int]]) -> None:
    asyncio.run(play(max_queued, ops))


def test_a_bound_below_max_running_does_not_cap_concurrency() -> None:
    """max_queued 1: eight requests run at once, each admitted while the one before runs."""
    ops = [op for _ in range(8) for op in (("submit", 0), ("start", 0))]
    assert asyncio.run(play(1, ops)) == 8


def test_refuse_posts_one_command_with_the_rooms_and_the_default_port() -> None:
    backend, inbox = make(4)
    backend.refuse([Target("10.0.0.1", 9000, 5), Target("10.0.0.1", None, 6), Target()],
                   "queue_full", "full")
    [cmd] = inbox.get_all(0)
    assert cmd == RefuseRequest((("10.0.0.1", 9000, 5), ("10.0.0.1", 8998, 6)), "queue_full",
                                "full", 3)


def test_a_refused_request_never_reaches_the_engine() -> None:
    backend, inbox = make(1)

    async def run() -> None:
        first = backend.generate(GenerateInput("a", [1], SamplingParams(max_new_tokens=2)))
        task = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)
        second = backend.generate(GenerateInput("b", [1], SamplingParams(max_new_tokens=2)))
        try:
            await anext(second)
            raise AssertionError("not refused")
        except QueueFull:
            pass
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await first.aclose()

    asyncio.run(run())
    added = [c.rid for c in inbox.get_all(0) if isinstance(c, AddRequest)]
    assert added == ["a"]
