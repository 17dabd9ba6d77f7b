"""The decode stepper over the device-time stand-in (`FakeDeviceRunner`): overlapped scheduling
launches step N+1 before it commits step N, feeds step N's tokens to step N+1 on the device
(future token ids), gives the same tokens as running each step to the end, and launches no step
for a request that its previous step ends by length."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.core.request import RequestState
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import Ended, Tokens, per_request
from decode_worker.daemon.decode.parking import Wait
from decode_worker.daemon.decode.stepper import DecodeStepper
from decode_worker.device.sampler import ParamsBatch
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
    assert not stepper.batch and stepper.batch.inputs.num_free == 6  # every row came back


def test_the_batch_samples_with_the_parameters_of_each_request() -> None:
    """A sampled batch takes its parameters from the batch's arrays (no per-request rows):
    they are exactly what each request's own sample row gives, seeded rows keyed by the index
    of the token they sample, one further while a step is uncommitted."""
    def sp(**kw: object) -> SamplingParams:
        return SamplingParams(max_new_tokens=50, ignore_eos=True, **kw)  # type: ignore[arg-type]

    params = [sp(temperature=0), sp(temperature=0.7), sp(temperature=1.3, top_k=5),
              sp(temperature=0.9, top_p=0.8, min_p=0.05, seed=11), sp(temperature=0, seed=3),
              sp(temperature=0.5, seed=12345)]
    stepper = running_stepper(FakeDeviceRunner(0.0), len(params), 40, True, params=params)
    for _ in range(3):
        stepper.step(time.monotonic())
    batch = stepper.batch
    order = batch.order()
    ahead = batch.ahead[order.rows]
    assert ahead.tolist() == [1] * len(params)  # overlapped: a step is in flight
    got = batch.sample_params(order.rows, ahead, 64, torch.device("cpu"))
    rows = [replace(lv.sample_row(), step=len(lv.req.output_ids) + 1) for lv in order.lives]
    want = ParamsBatch.of_rows(rows, 64, torch.device("cpu"))
    for name in ("temperature", "top_k", "top_p", "min_p", "greedy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=name)
    assert (got.all_greedy, got.any_filter) == (want.all_greedy, want.any_filter) == (False, True)
    assert got.seeded == want.seeded and len(got.seeded) == 2  # the greedy seeded row draws none


def test_pages_of_a_request_ended_under_a_launched_step_wait_for_that_step() -> None:
    """With overlap on, a request that ends (here: a client abort) while a launched step still
    writes its KV keeps its pages until the stepper has waited for that step: a page freed
    earlier could be handed to a new request whose KV transfer the step would then overwrite
    (on a GPU the step and the NIXL write are not ordered). Off, they go at once."""
    for overlap in (False, True):
        stepper = running_stepper(FakeDeviceRunner(0.0), 2, 40, overlap)
        stepper.step(time.monotonic())
        table, full = stepper.table, stepper.decode_alloc.ctx.full
        live = table.lives["r0"]
        held = len(live.req.kv.full_page_ids)  # type: ignore[union-attr]
        free = full.num_free
        table.end(live, "client_abort", "aborted: client_abort", time.monotonic())
        assert "r0" not in table.lives and live not in stepper.batch
        if overlap:
            steps = table.parked.at(Wait.STEPS)
            assert [r.live for r in steps] == [live] and full.num_free == free
            assert live.req in table.holders()
            table.poll(time.monotonic())  # the step is not waited for: nothing moves
            assert full.num_free == free
            stepper.step(time.monotonic())  # waits for the launched step
            table.poll(time.monotonic())
        assert not table.parked.has(Wait.STEPS) and full.num_free == free + held
        assert live.req.state is RequestState.ABORTED


def test_logprobs_come_from_the_device_without_a_synchronous_step() -> None:
    """Rows asking for logprobs (the token's, top alternatives) no longer make the batch
    sample on the host: the step stays overlapped, and tokens and logprobs are those of
    synchronous steps (and of the sampler's own logprobs of the same logits)."""
    def stepped(overlap: bool) -> tuple[DecodeStepper, dict[str, list[tuple[int, float]]]]:
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        stepper = running_stepper(FakeDeviceRunner(0.0), 3, 30, overlap, params=params,
                                  keep_events=True, logprobs=[(True, 0), (True, 3), (False, 0)])
        stepper.step(time.monotonic())
        assert stepper.busy == overlap  # launched and left in flight with overlap on
        while stepper.table.running or stepper.busy:
            stepper.step(time.monotonic())
        outbox = stepper.table.outbox
        assert isinstance(outbox, SinkOutbox)
        got: dict[str, list[tuple[int, float]]] = {}
        for ev in outbox.events:
            if isinstance(ev, Tokens) and ev.chunk.logprobs is not None:
                got.setdefault(ev.rid, []).extend(zip(ev.chunk.token_ids, ev.chunk.logprobs,
                                                      strict=True))
        tops = [e.chunk.top_logprobs for e in outbox.events
                if isinstance(e, Tokens) and e.rid == "r1" and e.chunk.top_logprobs]
        assert tops and all(len(t) == 3 for chunk in tops for t in chunk)
        return stepper, got

    _, off = stepped(False)
    _, on = stepped(True)
    assert on == off and set(on) == {"r0", "r1"} and len(on["r0"]) == 12  # prefill's + 11
    one_hot = torch.zeros(64)
    one_hot[0] = 1.0
    want = float(torch.log_softmax(one_hot, dim=0)[0])  # the fake's logits are one-hot
    assert all(abs(lp - want) < 1e-6 for _, lp in on["r0"][1:])


@pytest.mark.parametrize("overlap", [False, True])
def test_an_ended_requests_kv_is_in_the_events_of_the_step_that_answers_it(
        overlap: bool) -> None:
    """The step that puts a request's `Ended` in the outbox has already recorded the tree
    events naming all its computed KV (its page-aligned prompt and output), overlap on or off:
    the engine publishes a step's events before it flushes the step's answers, so a router
    that reads them sees what the client's next turn will hit. With overlap on, the request's
    pages still wait for the launched step (parked: STEPS), but its KV is in the tree already."""
    seqs = tokens_of(run(False, 30, ctx=42, bs=4))
    stop = seqs["r0"][6]  # r0 ends with KV for 42 + 6 tokens: a page its prompt did not fill
    params = SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[stop])
    trees: list[UnifiedRadixTree] = []

    def tree(full: PageAllocator, swa: PageAllocator) -> UnifiedRadixTree:
        trees.append(UnifiedRadixTree(16, 127, full, swa, kv_events=True))
        return trees[0]

    stepper = running_stepper(FakeDeviceRunner(0.0), 4, 42, overlap, params=params,
                              keep_events=True, tree=tree)
    lives = dict(stepper.table.lives)
    outbox = stepper.table.outbox
    assert isinstance(outbox, SinkOutbox)
    index, seen, settled, grown = KVEventIndex(), 0, 0, 0
    while stepper.table.running or stepper.busy:
        stepper.step(time.monotonic())
        index.apply(trees[0].take_events())  # what the engine publishes at the step's end
        for ev in outbox.events[seen:]:
            if isinstance(ev, Ended):
                fill = lives[ev.rid].req.fill_ids  # every token whose KV was computed
                assert index.match_len(fill) == len(fill) // 16 * 16, (ev.rid, ev.reason)
                grown += len(fill) // 16 > len(lives[ev.rid].req.prompt_ids) // 16
        seen = len(outbox.events)
        settled += stepper.table.parked.count(Wait.STEPS)
        stepper.table.poll(time.monotonic())  # the engine's next step: settled ends leave
    assert sum(isinstance(e, Ended) and e.reason == "stop" for e in outbox.events) >= 1
    assert grown >= 1  # a page the request's own output filled
    assert (settled > 0) == overlap  # on: the stop-token ends waited for a launched step
    assert index.orphan_stores == index.duplicate_stores == index.unknown_removals == 0
    trees[0].check_integrity()
