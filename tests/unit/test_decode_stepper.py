"""The decode stepper over the device-time stand-in (`FakeDeviceRunner`): overlapped scheduling
launches step N+1 before it commits step N, feeds step N's tokens to step N+1 on the device
(future token ids), gives the same tokens as running each step to the end, and launches no step
for a request that its previous step ends by length."""

from __future__ import annotations

import time

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import Ended, Tokens, per_request
from decode_worker.daemon.decode.stepper import DecodeStepper
from tests.fakes.fake_device import FakeDeviceRunner, SinkOutbox, running_stepper


def tokens_of(stepper: DecodeStepper) -> dict[str, list[int]]:
    return {lv.rid: list(lv.req.output_ids) for lv in stepper.table.lives.values()}


def run(overlap: bool, steps: int, ctx: int = 30, bs: int = 3) -> DecodeStepper:
    stepper = running_stepper(FakeDeviceRunner(0.0), bs, ctx, overlap)
    for _ in range(steps):
        stepper.step(time.monotonic())
    return stepper


def test_overlap_launches_the_next_step_before_committing() -> None:
    stepper = run(overlap=True, steps=1)
    runner = stepper.runner
    assert isinstance(runner, FakeDeviceRunner)
    assert stepper.busy and runner.steps == 1
    assert all(len(t) == 1 for t in tokens_of(stepper).values())  # only prefill's token
    stepper.step(time.monotonic())
    assert runner.steps == 2 and all(len(t) == 2 for t in tokens_of(stepper).values())


@pytest.mark.parametrize("ctx", [30, 130])  # page edges, and a context past the SWA window
def test_overlap_gives_the_tokens_of_synchronous_steps(ctx: int) -> None:
    steps = 40  # crosses page edges: new full and SWA pages reach the persistent rows
    off, on = run(False, steps, ctx), run(True, steps + 1, ctx)  # on: one step committed later
    assert tokens_of(on) == tokens_of(off)
    assert all(len(t) == steps + 1 for t in tokens_of(off).values())
    assert len(set(tokens_of(off)["r0"])) > 5  # the fake's tokens depend on the inputs


def test_no_step_is_launched_for_a_request_ending_by_length() -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    counts = []
    for overlap in (False, True):
        runner = FakeDeviceRunner(0.0)
        stepper = running_stepper(runner, 2, 20, overlap, params=params, keep_events=True)
        while stepper.table.running or stepper.busy:
            stepper.step(time.monotonic())
        outbox = stepper.table.outbox
        assert isinstance(outbox, SinkOutbox)
        assert sum(isinstance(e, Ended) for e in outbox.events) == 2
        sent = [t for e in per_request(outbox.events) if isinstance(e, Tokens)
                for t in e.chunk.token_ids]
        assert len(sent) == 8 and not stepper.table.lives  # 4 tokens each, both ended
        counts.append(runner.steps)
    assert counts == [3, 3]  # prefill gave token 1; three steps give tokens 2..4


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_token_ends_each_request_at_its_first_occurrence(overlap: bool) -> None:
    """The batch finds rows whose token may end them with one lookup (`stop_hits`): every
    request ends at its own first stop token, with "stop", and the others go on."""
    free = run(False, 30, ctx=40, bs=6)
    seqs = tokens_of(free)
    stop = seqs["r0"][6]
    params = SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[stop])
    stepper = running_stepper(FakeDeviceRunner(0.0), 6, 40, overlap, params=params,
                              keep_events=True)
    while stepper.table.running or stepper.busy:
        stepper.step(time.monotonic())
    outbox = stepper.table.outbox
    assert isinstance(outbox, SinkOutbox)
    sent: dict[str, list[int]] = {}
    for ev in per_request(outbox.events):
        if isinstance(ev, Tokens):
            sent.setdefault(ev.rid, []).extend(ev.chunk.token_ids)
    ended = {e.rid: e for e in outbox.events if isinstance(e, Ended)}
    assert set(sent) == set(ended) == set(seqs)
    for rid, got in sent.items():  # (pages freed by an ended request change the fake's tokens)
        if ended[rid].reason == "stop":
            assert got[-1] == stop and stop not in got[:-1], rid
        else:
            assert ended[rid].reason == "length" and len(got) == 30 and stop not in got, rid
    assert ended["r0"].reason == "stop" and sent["r0"] == seqs["r0"][:7]
    assert not stepper.batch and stepper.batch.slots.num_free == 6  # every row came back
