"""The engine's FlushCache command and its published load, in-process (model, pools, tree,
queue; requests prefilled locally): a flush on an idle engine puts every cached page back in
the pools with balanced books, and a later identical request reuses nothing but decodes the
same tokens; a flush while a request runs or waits changes nothing. Load counts running and
queued requests and their tokens, and falls back to zero when idle."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import (
    AddRequest,
    CacheFlushed,
    Ended,
    Event,
    FlushCache,
    Outbox,
    Tokens,
    per_request,
)
from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.io.api.backend import FlushResult, Load
from decode_worker.io.metrics import Metrics
from decode_worker.settings import load_settings

pytestmark = pytest.mark.slow
_RNG = random.Random(3)
PROMPT = [_RNG.randrange(3, 250) for _ in range(150)]  # longer than window + a page
OTHER = [_RNG.randrange(3, 250) for _ in range(40)]


class Driver:
    """Steps an engine by hand and plays the event loop: `tokens` collects every request's
    output tokens, flush answers are returned by `flush`."""

    def __init__(self, eng: DecodeEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.eng, self.loop = eng, loop
        self.events: list[Event] = []
        eng.outbox = Outbox(loop, self.events.extend)
        self.tokens: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: list[int], max_new: int) -> None:
        self.eng.inbox.put(AddRequest(rid, prompt, SamplingParams(
            max_new_tokens=max_new, temperature=0, ignore_eos=True), False, None, None, None,
            0.0))

    def step(self) -> list[CacheFlushed]:
        """One engine step; the flush answers it handed to the loop."""
        self.eng.step(time.monotonic())
        self.loop.run_until_complete(asyncio.sleep(0))  # deliver call_soon callbacks
        answers = []
        for ev in per_request(self.events):
            if isinstance(ev, CacheFlushed):
                answers.append(ev)
                continue
            assert isinstance(ev, Tokens | Ended)
            if isinstance(ev, Ended):
                assert ev.finished, ev.message  # no request ends in an error
                continue
            assert ev.chunk.error is None
            self.tokens.setdefault(ev.rid, []).extend(ev.chunk.token_ids)
        self.events.clear()
        return answers

    def flush(self, token: int) -> FlushResult:
        self.eng.inbox.put(FlushCache(token))
        answers = self.step()
        assert [a.token for a in answers] == [token]
        return answers[0].result

    def run_to_end(self) -> None:
        """Step until no request is left (those in the inbox too)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            self.step()
            if not (self.eng.table.lives or self.eng.table.parked):
                return  # that step published the idle load
        raise AssertionError(f"requests did not finish in time: {list(self.eng.table.lives)}")


@pytest.fixture
def drv(model_dir: Path) -> Iterator[Driver]:
    settings = load_settings(overrides={
        "model.path": str(model_dir), "cache.page_size": 16, "cache.num_full_pages": 256,
        "cache.num_swa_pages": 64, "scheduler.cuda_graph": False,
        "scheduler.max_running_requests": 1,  # a second request waits in the prealloc queue
    }, environ={}).settings
    loop = asyncio.new_event_loop()
    eng = DecodeEngine.build(settings, Metrics())
    yield Driver(eng, loop)
    eng.receiver.close()
    loop.close()


def test_flush_on_an_idle_engine_empties_the_tree_and_balances_the_books(drv: Driver) -> None:
    eng = drv.eng
    assert eng.tree is not None and eng.swa is not None
    drv.add("a", PROMPT, 8)
    drv.run_to_end()
    full, swa = eng.tree.full_stats(), eng.tree.swa_stats()
    assert full.evictable > 0 and swa.evictable > 0
    load = eng.books.load
    # cached pages are not "in use"
    assert load == Load(0, 0, 0, load.measured_at, cache_hit_rate=load.cache_hit_rate)

    result = drv.flush(7)
    assert result == FlushResult(True, num_full_pages=full.evictable,
                                 num_swa_pages=swa.evictable)
    for st in (eng.tree.full_stats(), eng.tree.swa_stats()):
        assert (st.available, st.evictable, st.protected) == (st.total, 0, 0)
    eng.books.check_integrity()

    hits = eng.stats.prefix_hit_tokens_total
    drv.add("b", PROMPT, 8)
    drv.run_to_end()
    assert eng.stats.prefix_hit_tokens_total == hits  # nothing left to reuse
    assert drv.tokens["b"] == drv.tokens["a"]
    assert drv.flush(8).ok  # a second flush in a row: fine too
    eng.books.check_integrity()


def test_flush_is_refused_while_a_request_runs_or_waits(drv: Driver) -> None:
    eng = drv.eng
    assert eng.tree is not None
    drv.add("warm", OTHER, 4)  # cached, unrelated to what runs next: evictable throughout
    drv.run_to_end()
    cached = eng.tree.full_stats().evictable
    assert cached > 0
    drv.add("long", PROMPT, 60)
    drv.add("queued", PROMPT[:50], 4)
    drv.step()
    load = eng.books.load
    assert (load.num_running_reqs, load.num_waiting_reqs) == (1, 1)
    assert load.num_tokens >= len(PROMPT) + 50  # the running request's pages + the queued prompt

    refused = drv.flush(1)
    assert not refused.ok and "1 running and 1 waiting" in refused.message
    assert eng.tree.full_stats().evictable == cached  # nothing was evicted
    drv.run_to_end()
    assert len(drv.tokens["long"]) == 60 and len(drv.tokens["queued"]) == 4  # both carried on
    load = eng.books.load
    assert load.num_running_reqs == load.num_waiting_reqs == load.num_tokens == 0
    assert drv.flush(2).ok
    eng.books.check_integrity()
