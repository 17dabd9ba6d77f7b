"""Every way a request ends goes through the request table's one exit: finished, client abort
while queued and while running, a bad request, admission's own abort, a transfer whose peer is
gone, drain and shutdown. Each request is answered once, released once, and no code outside the
exit (and admission's and the decode allocator's own transitions, which the exit and admission
call) moves a request to a terminal state; afterwards the books balance."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decode_worker.core import request as core_request
from decode_worker.core.request import TERMINAL, DecodeRequest, RequestState
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode import requests as table_module
from decode_worker.daemon.decode.bridge import (
    AbortRequest,
    AddRequest,
    Drain,
    Ended,
    Event,
    Outbox,
    Shutdown,
)
from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.daemon.shared.procs import free_port
from decode_worker.io.metrics import Metrics
from decode_worker.settings import load_settings

# (function, module) pairs allowed to make a terminal transition
ALLOWED_ENDERS = {("_release", "decode_worker.daemon.decode.requests"),
                  ("_abort", "decode_worker.core.admission")}


class Recorder:
    """Counts the exit's calls per rid and who made each terminal transition."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ends: Counter[str] = Counter()
        self.releases: Counter[str] = Counter()
        self.enders: set[tuple[str, str]] = set()
        table = table_module.RequestTable
        end, release = table.end, table._release
        transition = DecodeRequest.transition

        def counted_end(t: Any, live: Any, *a: Any, **k: Any) -> None:
            if live.ended is None:
                self.ends[live.rid] += 1
            end(t, live, *a, **k)

        def counted_release(t: Any, live: Any, *a: Any, **k: Any) -> None:
            self.releases[live.rid] += 1
            release(t, live, *a, **k)

        def watched(req: DecodeRequest, to: RequestState, *a: Any, **k: Any) -> None:
            if to in TERMINAL:
                caller = sys._getframe(1)
                self.enders.add((caller.f_code.co_name, caller.f_globals["__name__"]))
            transition(req, to, *a, **k)

        monkeypatch.setattr(table, "end", counted_end)
        monkeypatch.setattr(table, "_release", counted_release)
        monkeypatch.setattr(core_request.DecodeRequest, "transition", watched)


@pytest.fixture
def engine(
        model_dir: Path) -> Iterator[tuple[DecodeEngine, list[Event], asyncio.AbstractEventLoop]]:
    settings = load_settings(overrides={
        "model.path": str(model_dir), "cache.page_size": 16, "cache.num_full_pages": 64,
        "cache.num_swa_pages": 32, "scheduler.cuda_graph": False,
        "scheduler.max_running_requests": 2, "scheduler.decode_reserve_tokens": 0,
        "transfer.heartbeat_interval_s": 0.1, "transfer.peer_dead_after_s": 0.5,
        "transfer.abort_quiesce_s": 0.2,
    }, environ={}).settings
    loop = asyncio.new_event_loop()
    eng = DecodeEngine.build(settings, Metrics())
    events: list[Event] = []
    eng.outbox = Outbox(loop, events.extend)
    yield eng, events, loop
    loop.close()


def add(eng: DecodeEngine, rid: str, prompt: list[int], max_new: int, *,
        peer_port: int | None = None) -> None:
    host, room = ("127.0.0.1", 7) if peer_port else (None, None)
    eng.inbox.put(AddRequest(rid, prompt, SamplingParams(
        max_new_tokens=max_new, temperature=0, ignore_eos=True), False, host, peer_port, room,
        0.0))


def step_until(eng: DecodeEngine, loop: asyncio.AbstractEventLoop, done: Any,
               limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        eng.step(time.monotonic())
        loop.run_until_complete(asyncio.sleep(0))


def test_every_end_goes_through_the_one_exit(
        engine: tuple[DecodeEngine, list[Event], asyncio.AbstractEventLoop],
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, events, loop = engine
    rec = Recorder(monkeypatch)
    prompt = list(range(3, 43))
    add(eng, "finish", prompt, 4)
    add(eng, "run-abort", prompt[::-1], 500)
    add(eng, "queued-abort", prompt, 4)  # two may run at once: this one waits for a slot
    add(eng, "bad", [10**9], 4)  # outside the vocabulary
    add(eng, "too-large", [3 + i % 200 for i in range(16 * 70)], 4)  # more pages than the pool
    step_until(eng, loop, lambda: len(eng.table.running) == 2)
    assert eng.table.lives["queued-abort"].req.state is RequestState.QUEUED
    eng.inbox.put(AbortRequest("queued-abort", "client_abort"))
    step_until(eng, loop, lambda: "finish" not in eng.table.lives)
    eng.inbox.put(AbortRequest("run-abort", "client_abort"))
    step_until(eng, loop, lambda: not eng.table.lives)
    add(eng, "peer-gone", prompt, 4, peer_port=free_port())  # nothing listens there
    step_until(eng, loop, lambda: any(isinstance(ev, Ended) and ev.rid == "peer-gone"
                                      for ev in events))
    step_until(eng, loop, lambda: not eng.table.lives and not eng.table.parked)
    add(eng, "drained", prompt, 500)
    add(eng, "drained-queued", prompt[1:], 500)
    add(eng, "drained-waiting", prompt[2:], 500)
    step_until(eng, loop, lambda: len(eng.table.running) == 2)
    eng.inbox.put(Drain(0.0))
    step_until(eng, loop, lambda: not eng.table.lives)
    add(eng, "at-shutdown", prompt, 500)
    eng.inbox.put(Shutdown())
    eng.step(time.monotonic())
    eng._close()
    loop.run_until_complete(asyncio.sleep(0))

    ended = {ev.rid: ev for ev in events if isinstance(ev, Ended)}
    rids = ["finish", "run-abort", "queued-abort", "bad", "too-large", "peer-gone", "drained",
            "drained-queued", "drained-waiting", "at-shutdown"]
    assert sorted(ended) == sorted(rids)
    assert Counter(ev.rid for ev in events if isinstance(ev, Ended)) == Counter(rids)
    assert rec.ends == Counter(rids) and rec.releases == Counter(rids)
    assert rec.enders <= ALLOWED_ENDERS, rec.enders - ALLOWED_ENDERS
    reasons = {rid: ev.reason for rid, ev in ended.items()}
    assert reasons["finish"] == "length" and reasons["bad"] == "bad_request"
    assert reasons["run-abort"] == reasons["queued-abort"] == "client_abort"
    assert reasons["too-large"] == "too_large" and reasons["at-shutdown"] == "drain"
    assert reasons["peer-gone"] in ("peer_dead", "transfer_failed")
    assert {reasons[r] for r in ("drained", "drained-queued", "drained-waiting")} == {"drain"}
    assert not eng.table.lives and not eng.table.parked
    eng.books.check_integrity()
    assert eng.tree is not None
    assert eng.full.num_free + eng.tree.full_stats().evictable == eng.full.num_total
