"""The join gate of the host tier in the real engine: a request restored from the host tier
joins the batch only once its KV is in (transfer done, or ready to prefill locally) AND its
restore is done, and an abort, a drain or a dead prefill during a restore returns its pages only
once the restore stopped writing them.

A restore on CPU is synchronous, so `FakeSlowRestore` stands in for a CUDA restore still in
flight: the real copy is made, but the handle says "not done" until the test lets it finish.
`FakePeerReceiver` stands in for the prefill peer's side of the transfer (its "done", "failed"
and "released" events come when the test says), over the engine's real receiver.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decode_worker.core.host_tier import HostRestore
from decode_worker.core.request import RequestState
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import (
    AbortRequest,
    AddRequest,
    Drain,
    Ended,
    Event,
    Tokens,
    per_request,
)
from decode_worker.daemon.decode.engine import DecodeEngine
from decode_worker.device.host_pool import HostKVPool, RestoreHandle
from decode_worker.io.kv.peer_protocols import PeerProtocol
from tests.fakes.fake_receiver import FakeReceiver
from tests.integration.conftest import recording_engine

S = RequestState
MAX_NEW = 4
PEER = ("127.0.0.1", 43999)  # never dialled: the fake receiver answers for it


class FakeSlowRestore(RestoreHandle):
    """A restore whose copy was made but which reports done only after `finish()`."""

    done = False
    job: HostRestore | None = None

    def is_done(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.done = True


class FakePeerReceiver(FakeReceiver):
    """The engine's receiver, except that transfers are posted to nobody and end with the
    events the test queues (`done`, `fail`); an abort is acknowledged ("released") only
    when the test calls `release`. Everything else goes to the real receiver."""

    def __init__(self, real: Any) -> None:
        super().__init__(first_id=1000)
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def protocol_of(self, host: str, port: int, since: float) -> PeerProtocol:
        return PeerProtocol("native")

    def done(self, engine: DecodeEngine, tid: int, token_id: int) -> None:
        kw = self.submitted[tid]
        engine.fetcher.aux.native.write(kw["aux_row"], kw["room"], token_id, -0.5, tid)
        self.queue("done", tid, wire_id=tid)

    def fail(self, tid: int) -> None:
        self.queue("failed", tid, reason="peer_dead", detail="FakePeer died")

    def release(self, tid: int) -> None:
        self.queue("released", tid)


@pytest.fixture
def gated(model_dir: Path, loop: asyncio.AbstractEventLoop,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[DecodeEngine, list[Event],
                                                             list[FakeSlowRestore]]]:
    """An engine with a host tier whose cache holds a 300-token prompt host-only, and whose
    restores report done only when the test says."""
    engine, events = recording_engine(model_dir, loop, **{
        "cache.num_full_pages": 40, "cache.num_swa_pages": 64,
        "cache.hierarchical_cache": True, "cache.hicache_ratio": 8.0})
    _step_until_ended(engine, events, "warm", PROMPT)
    assert engine.tree is not None and engine.host_tier is not None
    engine.tree.evict_full(engine.full.num_total)  # everything demoted to the host tier
    slow: list[FakeSlowRestore] = []
    real = HostKVPool.restore

    def slow_restore(pool: HostKVPool, job: HostRestore) -> RestoreHandle:
        h = real(pool, job)
        slow.append(FakeSlowRestore(h.num_pages, h.num_bytes, h.started_s))
        slow[-1].job = job
        return slow[-1]

    monkeypatch.setattr(HostKVPool, "restore", slow_restore)
    yield engine, events, slow
    engine.books.check_integrity()
    engine.receiver.close()


PROMPT = [random.Random(7).randrange(3, 250) for _ in range(300)]


def _add(engine: DecodeEngine, rid: str, prompt: list[int], peer: bool = False) -> None:
    host, port = PEER if peer else (None, None)
    engine.inbox.put(AddRequest(rid, prompt, SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True), False, host, port,
        7 if peer else None, 0.0))


def _steps(engine: DecodeEngine, n: int) -> None:
    for _ in range(n):
        engine.step(time.monotonic())
        engine.outbox.loop.run_until_complete(asyncio.sleep(0))


def _step_until_ended(engine: DecodeEngine, events: list[Event], rid: str,
                      prompt: list[int] | None = None) -> Ended:
    if prompt is not None:
        _add(engine, rid, prompt)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _steps(engine, 1)
        ended = [e for e in events if isinstance(e, Ended) and e.rid == rid]
        if ended:
            return ended[0]
    raise AssertionError(f"{rid} did not end")


def _tokens(events: list[Event], rid: str) -> list[int]:
    return [t for e in per_request(events) if isinstance(e, Tokens) and e.rid == rid
            for t in e.chunk.token_ids]


def _free_full(engine: DecodeEngine) -> int:
    return engine.full.num_free


def test_a_local_request_joins_only_once_its_restore_is_done(
        gated: tuple[DecodeEngine, list[Event], list[FakeSlowRestore]]) -> None:
    engine, events, slow = gated
    _add(engine, "b", [*PROMPT, 5, 6, 7])
    _steps(engine, 5)
    live = engine.table.lives["b"]
    assert len(slow) == 1 and live.req.state is S.RESERVED and not _tokens(events, "b")
    assert engine.books.queue_sizes().transfer == 1  # waits as a transfer would
    slow[0].done = True
    ended = _step_until_ended(engine, events, "b")
    assert ended.finished and len(_tokens(events, "b")) == MAX_NEW
    assert engine.host_tier is not None and engine.host_tier.restored_pages_total > 0


def test_a_transferred_request_joins_only_once_its_restore_is_done(
        gated: tuple[DecodeEngine, list[Event], list[FakeSlowRestore]]) -> None:
    engine, events, slow = gated
    fake = FakePeerReceiver(engine.receiver)
    engine.fetcher.receiver = engine.table.transfers = fake  # type: ignore[assignment]
    _add(engine, "p", [*PROMPT, 5, 6, 7], peer=True)
    _steps(engine, 3)
    (tid, posted), = fake.submitted.items()
    assert posted["reused_len"] > 0 and len(slow) == 1  # host hits advertised, restore begun
    # the peer is asked for [reused_len, prompt_len) only: not into the restore's pages
    ps = engine.page_size
    assert len(posted["full_page_ids"]) == -(-posted["prompt_len"] // ps) - (
        posted["reused_len"] // ps)
    assert not set(posted["full_page_ids"]) & set(slow[0].job.device_page_ids)  # type: ignore[union-attr]
    fake.done(engine, tid, token_id=9)
    _steps(engine, 5)
    live = engine.table.lives["p"]
    assert live.req.state is S.RECEIVING and not live.req.output_ids  # KV in, not READY
    slow[0].done = True
    ended = _step_until_ended(engine, events, "p")
    assert ended.finished and _tokens(events, "p")[0] == 9


@pytest.mark.parametrize("how", ["client_abort", "drain", "dead_prefill"])
def test_an_end_during_a_restore_frees_its_pages_only_once_the_restore_is_done(
        gated: tuple[DecodeEngine, list[Event], list[FakeSlowRestore]], how: str) -> None:
    engine, events, slow = gated
    fake = FakePeerReceiver(engine.receiver)
    engine.fetcher.receiver = engine.table.transfers = fake  # type: ignore[assignment]
    free_before = _free_full(engine)
    _add(engine, "x", [*PROMPT, 5, 6, 7], peer=True)
    _steps(engine, 3)
    (tid, _), = fake.submitted.items()
    held = free_before - _free_full(engine)
    assert held > 0 and len(slow) == 1
    if how == "client_abort":
        fake.done(engine, tid, token_id=9)  # KV in, restore pending: it waits at the gate
        _steps(engine, 2)
        engine.inbox.put(AbortRequest("x", "client_abort"))
    elif how == "drain":
        fake.done(engine, tid, token_id=9)
        engine.inbox.put(Drain(grace_s=0.0))
    else:  # the peer died mid-transfer; the receiver releases the pages once it is quiet
        fake.fail(tid)
    ended = _step_until_ended(engine, events, "x")
    assert not ended.finished  # answered at once
    if how == "dead_prefill":
        fake.release(tid)
    _steps(engine, 5)
    assert _free_full(engine) == free_before - held  # the restore still writes them
    engine.books.check_integrity()  # held by the ended request, not leaked
    slow[0].done = True
    _steps(engine, 2)
    assert _free_full(engine) > free_before - held and not engine.table.parked


def test_the_kv_backstop_during_a_restore_waits_for_the_copy_before_its_pages_go_back(
        gated: tuple[DecodeEngine, list[Event], list[FakeSlowRestore]]) -> None:
    """Admission's `kv_timeout` returns the pages itself: the engine waits for the restore then
    (a copy that late means a sick device), so no page it writes is handed out again."""
    engine, events, slow = gated
    fake = FakePeerReceiver(engine.receiver)
    engine.fetcher.receiver = engine.table.transfers = fake  # type: ignore[assignment]
    _add(engine, "late", [*PROMPT, 5, 6, 7], peer=True)
    _steps(engine, 3)
    (tid, _), = fake.submitted.items()
    fake.done(engine, tid, token_id=9)  # KV in; the restore never finishes by itself
    _steps(engine, 2)
    assert not slow[0].done
    engine.queue.limits = dataclasses.replace(engine.queue.limits, kv_timeout_s=0.0)
    ended = _step_until_ended(engine, events, "late")
    assert ended.reason == "kv_timeout" and slow[0].done  # waited for before the pages went back
    assert not engine.table.parked
