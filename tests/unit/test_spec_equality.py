"""Speculation on against off, token by token: whatever the drafts (right, wrong, partly right,
stop ids, longer than the budget, across page and window edges), greedy outputs are the same,
every token is sent once in order, and every page comes back."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode_worker.core.sampling import SamplingParams
from decode_worker.core.spec.drafter import SpecParams, make_drafter
from decode_worker.daemon.decode.speculate import Speculator
from tests.examples import examples
from tests.fakes.fake_device import FakeDeviceRunner
from tests.spec_rig import Rig, ScriptedDrafter

VOCAB, PAGE, WINDOW, K = 64, 16, 31, 6
MODES = ("right", "wrong", "partly", "stops", "long")


def _drafter(ref: dict[str, list[int]], prompts: dict[str, list[int]], modes: dict[str, str],
             seed: int) -> ScriptedDrafter:
    rng = random.Random(seed)

    def fn(rid: str, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - len(prompts[rid])  # output tokens so far
        truth = ref[rid][done:done + k + 3]
        mode = modes[rid]
        if mode == "right":
            return truth[:k]
        if mode == "long":
            return truth + [rng.randrange(VOCAB) for _ in range(5)]  # past k and the end
        if mode == "stops":
            return [1] * k  # the stop id, everywhere
        if mode == "partly":
            cut = rng.randrange(k + 1)
            return truth[:cut] + [(t + 1) % VOCAB for t in truth[cut:k]]
        return [rng.randrange(VOCAB) for _ in range(k)]

    return ScriptedDrafter(fn)


def _run(prompts: dict[str, list[int]], params: dict[str, SamplingParams],
         spec: Speculator | None, overlap: bool, radix: bool) -> dict[str, list[int]]:
    runner = FakeDeviceRunner(0.0, vocab=VOCAB, page_size=PAGE, window=WINDOW, lookahead=K,
                              read_pages=False)
    rig = Rig(runner, spec=spec, overlap=overlap, page_size=PAGE, window=WINDOW, radix=radix)
    for rid, prompt in prompts.items():
        rig.add(rid, prompt, 5, params[rid])
    out = {rid: list(v) for rid, v in rig.run().items()}
    rig.check_pages()
    return out


@settings(max_examples=examples(60), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.sampled_from([1, 2, 15, 16, 17, 31, 32, 33, 40, 63, 64, 90]),
                        min_size=1, max_size=5),
       max_new=st.lists(st.integers(1, 40), min_size=5, max_size=5),
       stops=st.lists(st.booleans(), min_size=5, max_size=5),
       modes=st.lists(st.sampled_from(MODES), min_size=5, max_size=5),
       overlap=st.booleans(), radix=st.booleans(), seed=st.integers(0, 2**16))
def test_greedy_outputs_are_the_same_with_and_without_drafts(
        lengths: list[int], max_new: list[int], stops: list[bool], modes: list[str],
        overlap: bool, radix: bool, seed: int) -> None:
    prompts = {f"r{i}": [(i * 13 + j * 7) % (VOCAB - 2) + 2 for j in range(n)]
               for i, n in enumerate(lengths)}
    params = {rid: SamplingParams(max_new_tokens=max_new[i], temperature=0,
                                  stop_token_ids=[1] if stops[i] else [], ignore_eos=True)
              for i, rid in enumerate(prompts)}
    ref = _run(prompts, params, None, overlap, radix)
    by_rid = {rid: modes[i] for i, rid in enumerate(prompts)}
    drafter = _drafter(ref, prompts, by_rid, seed)
    spec = Speculator(drafter, K, None)
    got = _run(prompts, params, spec, overlap, radix)
    assert got == ref
    assert sorted(drafter.finished) == sorted(prompts)  # every request's drafts forgotten
    right = [rid for rid in prompts if by_rid[rid] == "right" and len(ref[rid]) > 2]
    if right:  # right drafts are kept: fewer verify steps than tokens
        assert spec.stats.accepted_total > 0


def test_sampled_requests_verify_drafts_and_keep_their_lengths() -> None:
    """Sampled (and seeded) requests verify drafts by rejection: each gets exactly its
    max_new_tokens, every token in the vocabulary, every page back."""
    prompts = {f"s{i}": [(i * 5 + j) % (VOCAB - 2) + 2 for j in range(20 + i)] for i in range(4)}
    params = {rid: SamplingParams(max_new_tokens=30, temperature=0.8, top_k=8,
                                  seed=11 if i % 2 else None, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    drafter = ScriptedDrafter(lambda rid, tokens, k: tokens[-k:])  # recent tokens again
    spec = Speculator(drafter, K, None)
    got = _run(prompts, params, spec, True, False)
    assert all(len(v) == 30 and all(0 <= t < VOCAB for t in v) for v in got.values())
    assert spec.stats.verify_steps_total > 0 and spec.stats.proposed_total > 0


def _waves(prompts: list[list[int]], spec: Speculator | None) -> list[list[int]]:
    """Serve `prompts` twice, the second wave after the first ended; every output."""
    runner = FakeDeviceRunner(0.0, vocab=VOCAB, page_size=PAGE, window=WINDOW, lookahead=K,
                              read_pages=False)
    rig = Rig(runner, spec=spec, page_size=PAGE, window=WINDOW)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    for wave in range(2):
        for i, prompt in enumerate(prompts):
            rig.add(f"w{wave}r{i}", prompt, 5, params)
        out = rig.run()
    rig.check_pages()
    return [list(out[f"w{w}r{i}"]) for w in range(2) for i in range(len(prompts))]


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
def test_the_servers_drafters_keep_greedy_outputs_and_draft_from_repeats(algorithm: str) -> None:
    """The drafters `serve` runs (not a scripted one), through the verify path without a cost
    model: a second wave repeating the first (the shared memory) gives the tokens it gives
    without speculation, and its drafts are kept."""
    prompts = [[(i * 13 + j * 7) % (VOCAB - 2) + 2 for j in range(24 + i)] for i in range(3)]
    ref = _waves(prompts, None)
    spec = Speculator(make_drafter(SpecParams(algorithm, K)), K, None)  # type: ignore[arg-type]
    assert _waves(prompts, spec) == ref
    assert spec.stats.accepted_total >= 40  # the repeats are drafted
