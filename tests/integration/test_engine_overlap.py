"""Overlapped scheduling (`scheduler.overlap_schedule`): the decode engine gives the same greedy
tokens with it on and off, under page pressure (retraction), with stop tokens that end a request
while its next step is already launched, and with a seeded sampler; pages and locks balance
after. The real engine in-process (model, pools, tree, queue), requests prefilled locally."""

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


def make_engine(model_dir: Path, overlap: bool, num_full_pages: int,
                loop: asyncio.AbstractEventLoop) -> tuple[DecodeEngine, list[Event]]:
    return recording_engine(model_dir, loop, **{
        "cache.num_swa_pages": 64, "cache.num_full_pages": num_full_pages,
        "scheduler.overlap_schedule": overlap})


def run_all(engine: DecodeEngine, events: list[Event], prompts: list[list[int]],
            params: SamplingParams, loop: asyncio.AbstractEventLoop) -> dict[str, list[int]]:
    """Every prompt's tokens, stepping the engine until all ended (each must finish)."""
    for i, prompt in enumerate(prompts):
        engine.inbox.put(AddRequest(f"r{i}", prompt, params, False, None, None, None, 0.0))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    done: set[str] = set()
    overlapped = False
    deadline = time.monotonic() + 120
    while len(done) < len(prompts) and time.monotonic() < deadline:
        engine.step(time.monotonic())
        overlapped |= engine.stepper.busy
        loop.run_until_complete(asyncio.sleep(0))  # deliver call_soon callbacks
        for ev in per_request(events):
            assert isinstance(ev, Tokens | Ended)
            if isinstance(ev, Ended):
                assert ev.finished, ev.message
                done.add(ev.rid)
            else:
                out[ev.rid] += ev.chunk.token_ids
        events.clear()
    assert len(done) == len(prompts), f"unfinished: {set(out) - done}"
    assert overlapped == engine.settings.scheduler.overlap_schedule  # a step was left in flight
    return out


def both_ways(model_dir: Path, loop: asyncio.AbstractEventLoop, prompts: list[list[int]],
              params: SamplingParams, num_full_pages: int = 512
              ) -> tuple[dict[str, list[int]], dict[str, list[int]], DecodeEngine]:
    results, engines = [], []
    for overlap in (False, True):
        engine, events = make_engine(model_dir, overlap, num_full_pages, loop)
        results.append(run_all(engine, events, prompts, params, loop))
        for _ in range(3):  # a step launched before the last request hit its stop token
            if not engine.stepper.busy:  # is collected (and dropped) by the next step
                break
            engine.step(time.monotonic())
            loop.run_until_complete(asyncio.sleep(0))
        engine.books.check_integrity()  # every page free or cached; no request holds any
        assert not engine.table.lives and not engine.table.running and not engine.stepper.busy
        engine.receiver.close()
        engines.append(engine)
    return results[0], results[1], engines[1]


def prompts_of(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(20, 150))] for _ in range(n)]


def test_overlap_keeps_greedy_tokens_under_retraction(
        model_dir: Path, loop: asyncio.AbstractEventLoop) -> None:
    greedy = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    off, on, engine = both_ways(model_dir, loop, prompts, greedy, num_full_pages=16)
    assert engine.stats.retractions_total > 0, "the pool was meant to force retraction"
    assert on == off and all(len(t) == 60 for t in on.values())


def test_overlap_ends_at_the_same_stop_token(model_dir: Path,
                                             loop: asyncio.AbstractEventLoop) -> None:
    prompts = prompts_of(1, 5)
    free = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    off, on, _ = both_ways(model_dir, loop, prompts, free)
    assert on == off
    stop = off["r0"][7]  # r0 ends at its 8th token: its 9th step was launched already
    stopping = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                              stop_token_ids=(stop,))
    off, on, _ = both_ways(model_dir, loop, prompts, stopping)
    assert on == off and len(on["r0"]) <= 8 and on["r0"][-1] == stop


def test_overlap_keeps_seeded_sampling(model_dir: Path, loop: asyncio.AbstractEventLoop) -> None:
    seeded = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=20, seed=7,
                            ignore_eos=True)
    off, on, _ = both_ways(model_dir, loop, prompts_of(2, 3), seeded)
    assert on == off


@pytest.mark.parametrize("overlap", [False, True])
def test_a_rid_reused_after_its_request_ended_gets_fresh_inputs(
        model_dir: Path, loop: asyncio.AbstractEventLoop, overlap: bool) -> None:
    """Persistent rows belong to a request, not to its rid: a later request named like an
    ended one decodes as on a fresh engine."""
    first, second = prompts_of(3, 2)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    engine, events = make_engine(model_dir, overlap, 512, loop)
    run_all(engine, events, [first], greedy, loop)  # "r0"
    reused = run_all(engine, events, [second], greedy, loop)  # "r0" again
    fresh_engine, fresh_events = make_engine(model_dir, overlap, 512, loop)
    assert reused == run_all(fresh_engine, fresh_events, [second], greedy, loop)
    for e in (engine, fresh_engine):
        e.receiver.close()
