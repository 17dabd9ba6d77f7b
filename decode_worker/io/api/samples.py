"""One HTTP request, many samples: `n > 1` and batches of prompts.

A request asks for `len(prompts) * n` samples; sample `k = i * n + j` is the j-th sample of
prompt i (OpenAI's choice index, SGLang's batch order). Each sample is a run of its own in the
backend, with its own transfer and room: sglang-router (PD mode) sends `bootstrap_host`,
`bootstrap_port` and `bootstrap_room` as arrays for an array prompt and one room for `n > 1`
(0.3.2), which SGLang spreads as room + k (`targets.py` has the rules). On the decode
worker the samples of one prompt share its prefix KV through the radix tree once they run.

Both servers (decode worker, prefill peer) build the samples from the same body with this
module, so they agree on every sample's room and seed: with a `seed`, sample j of each prompt
uses `seed + j` (the samples differ and stay reproducible).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from decode_worker.core.sampling import SamplingParams
from decode_worker.errors import ClientError
from decode_worker.io.api.backend import GenerateInput
from decode_worker.io.api.common import collect
from decode_worker.io.api.context import ApiContext
from decode_worker.io.api.run import Finish, GenerationRun, Step
from decode_worker.io.api.schemas import Bootstrap
from decode_worker.io.api.targets import sample_targets

MAX_SAMPLES = 128  # samples per HTTP request (len(prompts) * n)


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """One tokenized, checked prompt and the sampling its samples start from."""

    ids: list[int]
    sampling: SamplingParams


def check_n(n: int, num_prompts: int) -> int:
    """The number of samples; ClientError for n < 1 or more than MAX_SAMPLES in all."""
    if n < 1:
        raise ClientError(f"n={n}: must be >= 1")
    if num_prompts * n > MAX_SAMPLES:
        raise ClientError(f"{num_prompts} prompt(s) x n={n} = {num_prompts * n} samples; "
                          f"at most {MAX_SAMPLES} per request")
    return num_prompts * n


def sample_rids(rid: str | list[str] | None, num_samples: int) -> list[str | None]:
    """The client rid of each sample: a list gives one per sample; one rid for many samples
    is suffixed `-k`; None lets the app pick."""
    if isinstance(rid, list):
        if len(rid) != num_samples:
            raise ClientError(f"rid has {len(rid)} entries for {num_samples} samples")
        return list(rid)
    if rid is None or num_samples == 1:
        return [rid] * num_samples
    return [f"{rid}-{k}" for k in range(num_samples)]


def sample_sampling(base: SamplingParams, j: int) -> SamplingParams:
    """Sample j's sampling: a given seed becomes `seed + j`."""
    if j == 0 or base.seed is None:
        return base
    return dataclasses.replace(base, seed=base.seed + j)


def build_inputs(
    app: ApiContext, prompts: Sequence[Prompt], n: int, boot: Bootstrap,
    rid: str | list[str] | None, *, stream: bool, return_logprob: bool, top_logprobs: int,
    endpoint: str, received_at: float,
) -> list[GenerateInput]:
    """Every sample's GenerateInput, in sample order. Raises ClientError."""
    total = check_n(n, len(prompts))
    targets = sample_targets(boot, len(prompts), n)
    rids = sample_rids(rid, total)
    inps = []
    for k in range(total):
        prompt, j = prompts[k // n], k % n
        inps.append(app.make_input(
            rids[k], prompt.ids, sample_sampling(prompt.sampling, j), targets[k],
            stream=stream, return_logprob=return_logprob, endpoint=endpoint,
            received_at=received_at, top_logprobs=top_logprobs))
    return inps


async def start_all(app: ApiContext, inps: Sequence[GenerateInput]) -> list[GenerationRun]:
    """Start every sample at once and wait for each one's first chunk. If one fails to start
    (or the caller is cancelled), the others are ended and the first failure is raised."""
    tasks = [asyncio.ensure_future(app.start_run(inp)) for inp in inps]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        await _end_all(tasks)
        raise
    failed = next((t.exception() for t in tasks if t.exception() is not None), None)
    if failed is not None:
        await _end_all(tasks)
        raise failed
    return [t.result() for t in tasks]


async def _end_all(tasks: Sequence[asyncio.Future[GenerationRun]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is None:
            await task.result().close()


async def collect_all(runs: Sequence[GenerationRun]) -> Finish | None:
    """Run every sample to its end; the first error ends the others (and is returned)."""
    if len(runs) == 1:
        await collect(runs[0])
        return _error_of(runs[0])
    tasks = [asyncio.ensure_future(collect(run)) for run in runs]
    try:
        for next_done in asyncio.as_completed(tasks):
            error = _error_of(await next_done)
            if error is not None:
                return error
        return None
    finally:
        await _stop(tasks, runs)


async def _stop(tasks: Sequence[asyncio.Future[Any]], runs: Sequence[GenerationRun]) -> None:
    """Cancel the per-sample tasks, wait for them, then close every sample's run."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for run in runs:
        await run.close()


def _error_of(run: GenerationRun) -> Finish | None:
    fin = run.finish
    return fin if fin is not None and fin.reason == "error" else None


async def merged_steps(runs: Sequence[GenerationRun]) -> AsyncGenerator[tuple[int, Step], None]:
    """(sample index, step) as the samples produce them. Closing early ends every sample.
    One sample is read directly; many are read by one task each through a small queue, so a
    slow client still holds them back."""
    if len(runs) == 1:
        async with contextlib.aclosing(runs[0].steps()) as steps:
            async for step in steps:
                yield 0, step
        return
    queue: asyncio.Queue[tuple[int, Step | None]] = asyncio.Queue(maxsize=len(runs))

    async def pump(k: int, run: GenerationRun) -> None:
        try:
            async with contextlib.aclosing(run.steps()) as steps:
                async for step in steps:
                    await queue.put((k, step))
        except Exception as exc:  # the backend's iterator broke: this sample ends in error
            await queue.put((k, Step("", [], finish=Finish("error", message=str(exc)))))
        await queue.put((k, None))

    tasks = [asyncio.ensure_future(pump(k, run)) for k, run in enumerate(runs)]
    try:
        live = len(runs)
        while live:
            k, item = await queue.get()
            if item is None:
                live -= 1
            else:
                yield k, item
    finally:
        await _stop(tasks, runs)
