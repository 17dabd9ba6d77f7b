"""The host tier in the real engine (model, pools, tree, queue; requests prefilled locally):
multi-turn conversations that outgrow a small device pool are answered token for token as with
a large pool (restored KV is bit-exact), and a failing restore ends only its request."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest, Ended, Event, Tokens, per_request
from decode_worker.daemon.decode.engine import DecodeEngine
from tests.integration.conftest import recording_engine

pytestmark = pytest.mark.slow
MAX_NEW = 8


def _engine(model_dir: Path, loop: asyncio.AbstractEventLoop, full_pages: int,
            host: bool) -> tuple[DecodeEngine, list[Event]]:
    return recording_engine(model_dir, loop, **{
        "cache.num_full_pages": full_pages, "cache.num_swa_pages": 64,
        "cache.hierarchical_cache": host, "cache.hicache_ratio": 8.0})


def _run(engine: DecodeEngine, events: list[Event], rid: str,
         prompt: list[int]) -> tuple[list[int], str | None]:
    """One request to its end: (tokens, None) or (tokens, the failure message)."""
    engine.inbox.put(AddRequest(rid, prompt, SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True), False, None, None, None, 0.0))
    out: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engine.step(time.monotonic())
        engine.outbox.loop.run_until_complete(asyncio.sleep(0))
        for ev in per_request(events):
            if isinstance(ev, Ended):
                events.clear()
                return out, None if ev.finished else ev.message
            assert isinstance(ev, Tokens)
            out += ev.chunk.token_ids
        events.clear()
    raise AssertionError(f"{rid} did not end")


def _conversations(engine: DecodeEngine, events: list[Event]) -> dict[str, list[int]]:
    """Six chats, three turns each, interleaved (each turn = the last prompt + answer + more)."""
    rng = random.Random(3)
    chats = [[rng.randrange(3, 250) for _ in range(150)] for _ in range(6)]
    answers: dict[str, list[int]] = {}
    for turn in range(3):
        for c, prompt in enumerate(chats):
            toks, err = _run(engine, events, f"c{c}t{turn}", prompt)
            assert err is None, err
            answers[f"c{c}t{turn}"] = toks
            chats[c] = prompt + toks + [rng.randrange(3, 250) for _ in range(20)]
    return answers


def test_multi_turn_beyond_the_device_pool_matches_a_large_pool(
        model_dir: Path, loop: asyncio.AbstractEventLoop) -> None:
    roomy, ev1 = _engine(model_dir, loop, 512, host=False)
    want = _conversations(roomy, ev1)
    tight, ev2 = _engine(model_dir, loop, 40, host=True)
    assert tight.host_tier is not None
    got = _conversations(tight, ev2)
    assert got == want
    assert tight.stats.host_hit_tokens_total > 0 and tight.host_tier.restored_pages_total > 0
    small, ev3 = _engine(model_dir, loop, 40, host=False)
    _conversations(small, ev3)
    assert tight.stats.prefix_hit_tokens_total > small.stats.prefix_hit_tokens_total
    for engine in (roomy, tight, small):
        engine.books.check_integrity()
        engine.receiver.close()


def test_a_failing_restore_ends_only_that_request_and_returns_its_pages(
        model_dir: Path, loop: asyncio.AbstractEventLoop) -> None:
    engine, events = _engine(model_dir, loop, 40, host=True)
    assert engine.host_tier is not None
    rng = random.Random(5)
    first = [rng.randrange(3, 250) for _ in range(300)]
    toks, err = _run(engine, events, "a", first)
    assert err is None
    assert engine.tree is not None
    engine.tree.evict_full(engine.full.num_total)  # everything demoted to the host tier
    engine.host_tier.pool.fail_restores = 1
    _, err = _run(engine, events, "b", first + toks)
    assert err is not None and "restore failed" in err
    engine.books.check_integrity()
    again, err = _run(engine, events, "c", first + toks)  # the host copy is still there
    assert err is None and len(again) == MAX_NEW
    assert engine.host_tier.restored_pages_total > 0
    engine.books.check_integrity()
    engine.receiver.close()
