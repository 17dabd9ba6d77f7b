"""The decode backend's side of /flush_cache and /get_load, with no engine: the flush goes to the
inbox as a typed command and its answer comes back by token; a dead or silent engine is a 503;
the load is whatever the engine published last."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.daemon.decode import backend as decode_backend
from decode_worker.daemon.decode.backend import BackendInfo, DecodeBackend
from decode_worker.daemon.decode.bridge import CacheFlushed, EngineDead, FlushCache, Inbox
from decode_worker.errors import ServiceUnavailable
from decode_worker.io.api.backend import FlushResult, Load
from tests.fakes.fake_backend import ByteTokenizer

INFO = BackendInfo("/m", "m", 16, 127, 1024, 8, 64, 4096)


def make(load: Load | None = None) -> tuple[DecodeBackend, Inbox]:
    inbox = Inbox()
    return DecodeBackend(inbox, ByteTokenizer(), INFO, 8, 8998,
                         load=lambda: load or Load()), inbox


def test_flush_posts_a_command_and_returns_the_answer_with_its_token() -> None:
    backend, inbox = make()

    async def run() -> FlushResult:
        task = asyncio.ensure_future(backend.flush_cache())
        await asyncio.sleep(0)
        (cmd,) = inbox.get_all(0)
        assert isinstance(cmd, FlushCache)
        backend.deliver([CacheFlushed(cmd.token + 1, FlushResult(False, "not mine")),
                         CacheFlushed(cmd.token, FlushResult(True, num_full_pages=3))])
        return await task

    assert asyncio.run(run()) == FlushResult(True, num_full_pages=3)


def test_flush_fails_with_503_when_the_engine_dies_or_never_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = make()

    async def dies() -> None:
        task = asyncio.ensure_future(backend.flush_cache())
        await asyncio.sleep(0)
        backend.deliver([EngineDead("boom")])
        with pytest.raises(ServiceUnavailable, match="boom"):
            await task
        with pytest.raises(ServiceUnavailable):  # and every later flush, at once
            await backend.flush_cache()

    asyncio.run(dies())
    monkeypatch.setattr(decode_backend, "FLUSH_WAIT_S", 0.05)
    silent, _ = make()
    with pytest.raises(ServiceUnavailable, match="did not answer"):
        asyncio.run(silent.flush_cache())


def test_load_is_what_the_engine_published() -> None:
    published = Load(num_running_reqs=2, num_waiting_reqs=1, num_tokens=96, measured_at=1.0)
    backend, _ = make(published)
    assert backend.load() is published
