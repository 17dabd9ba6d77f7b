"""The decode backend's side of /flush_cache and /get_load, with no engine: the flush goes to the
inbox as a typed command and its answer comes back by token; a dead or silent engine is a 503;
the load is whatever the engine published last."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode import backend as decode_backend
from decode_worker.daemon.decode.backend import DecodeBackend
from decode_worker.daemon.decode.bridge import (
    BackendInfo,
    CacheFlushed,
    Ended,
    EngineDead,
    FlushCache,
    Inbox,
    PromptTotals,
    StepTokens,
    Tokens,
)
from decode_worker.errors import ServiceUnavailable
from decode_worker.io.api.backend import FlushResult, GenerateInput, Load, OutputChunk
from tests.fakes.fake_backend import ByteTokenizer

INFO = BackendInfo("/m", "m", 16, 127, 1024, 8, 64, 4096)


def make(load: Load | None = None) -> tuple[DecodeBackend, Inbox]:
    inbox = Inbox()
    return DecodeBackend(inbox, ByteTokenizer(), INFO, 8, 8998,
                         loads=SimpleNamespace(load=load or Load())), inbox


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


def test_step_tokens_reach_each_stream_with_its_totals_and_end_in_one_chunk() -> None:
    """A step's tokens come as one `StepTokens`; each request's chunk carries the totals of its
    first `Tokens`, and a request ending in the same batch gets one last chunk."""
    backend, _ = make()

    async def run() -> dict[str, list[OutputChunk]]:
        streams = {rid: backend.generate(GenerateInput(rid, [1, 2, 3], SamplingParams()))
                   for rid in ("a", "b")}
        got: dict[str, list[OutputChunk]] = {"a": [], "b": []}
        firsts = {rid: asyncio.ensure_future(s.__anext__()) for rid, s in streams.items()}
        await asyncio.sleep(0)
        backend.deliver([Tokens("a", OutputChunk([7]), PromptTotals(3, 2, 1)),
                         Tokens("b", OutputChunk([8]), PromptTotals(3, 0))])
        for rid, first in firsts.items():
            got[rid].append(await first)
        backend.deliver([StepTokens(["a", "b"], [9, 10])])
        backend.deliver([StepTokens(["b", "a"], [11, 12]),
                         Ended("a", "length", "", None, PromptTotals(3, 2, 1))])
        for rid, stream in streams.items():
            async for chunk in stream:
                got[rid].append(chunk)
                if rid == "b" and len(got[rid]) == 3:
                    await stream.aclose()
                    break
        return got

    got = asyncio.run(run())
    assert [c.token_ids for c in got["a"]] == [[7], [9], [12]]
    assert [(c.prompt_tokens, c.cached_tokens, c.host_cached_tokens)
            for c in got["a"]] == [(3, 2, 1)] * 3  # the host split rides along
    assert got["a"][-1].finish_reason == "length"
    assert [c.token_ids for c in got["b"]] == [[8], [10], [11]]
    assert all(c.cached_tokens == c.host_cached_tokens == 0 and c.finish_reason is None
               for c in got["b"])
