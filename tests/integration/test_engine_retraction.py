"""The decode engine under page pressure: retraction keeps every request's greedy tokens, and
pages and locks balance afterwards. Runs the real engine in-process (model, pools, tree, queue)
with requests prefilled locally (no bootstrap fields)."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest, Ended, Event, Tokens, per_request
from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.device.default_model import write_model
from tests.integration.conftest import recording_engine

pytestmark = pytest.mark.slow


def make_engine(model_dir: Path, num_full_pages: int, loop: asyncio.AbstractEventLoop,
                num_swa_pages: int | None = 64) -> tuple[DecodeEngine, list[Event]]:
    # no growth reserve (recording_engine): admission overcommits, so decode must retract
    return recording_engine(model_dir, loop, **{
        "cache.num_full_pages": num_full_pages, "cache.num_swa_pages": num_swa_pages})


def run_all(engine: DecodeEngine, events: list[Event], prompts: list[list[int]],
            max_new: int) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.inbox.put(AddRequest(
            f"r{i}", prompt, SamplingParams(max_new_tokens=max_new, temperature=0,
                                            ignore_eos=True), False, None, None, None, 0.0))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    done: set[str] = set()
    deadline = time.monotonic() + 120
    while len(done) < len(prompts) and time.monotonic() < deadline:
        engine.step(time.monotonic())
        engine.outbox.loop.run_until_complete(asyncio.sleep(0))  # deliver call_soon callbacks
        for ev in per_request(events):
            assert isinstance(ev, Tokens | Ended)
            if isinstance(ev, Ended):  # the end of a request: finished, or an error
                assert ev.finished, ev.message
                done.add(ev.rid)
                continue
            assert ev.chunk.error is None, ev.chunk.error
            out[ev.rid] += ev.chunk.token_ids
        events.clear()
    assert len(done) == len(prompts), f"unfinished: {set(out) - done}"
    return out


def test_retraction_under_page_pressure_keeps_greedy_tokens(
        model_dir: Path, loop: asyncio.AbstractEventLoop) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    max_new = 60  # 100 tokens = 7 pages each; 4 requests need 28 full pages, the pool has 16
    roomy, ev1 = make_engine(model_dir, 512, loop)
    solo = {f"r{i}": run_all(roomy, ev1, [p], max_new)["r0"] for i, p in enumerate(prompts)}
    tight, ev2 = make_engine(model_dir, 16, loop)
    together = run_all(tight, ev2, prompts, max_new)
    assert tight.stats.retractions_total > 0, "the pool was meant to force retraction"
    assert together == solo
    assert all(len(t) == max_new for t in together.values())
    for engine in (roomy, tight):
        # every page free or cached by the tree; no request holds any
        engine.books.check_integrity()
        assert not engine.table.lives and not engine.table.running
        engine.receiver.close()


def test_model_without_swa_layers_decodes_and_reuses_its_prefix(
        tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    dense = write_model(tmp_path / "dense", seed=0, layer_types=["full_attention"] * 4)
    engine, events = make_engine(dense, 256, loop, num_swa_pages=None)
    assert engine.swa is None
    rng = random.Random(1)
    prompt = [rng.randrange(3, 250) for _ in range(70)]
    first = run_all(engine, events, [prompt], 12)["r0"]
    again = run_all(engine, events, [prompt], 12)["r0"]
    assert len(first) == 12 and again == first
    assert engine.stats.prefix_hit_tokens_total >= 64  # the second run reused the cached pages
    engine.books.check_integrity()
    engine.receiver.close()
