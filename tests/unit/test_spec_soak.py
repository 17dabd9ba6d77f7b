"""Ten thousand random verifies (a request's drafts in a verify step) under page pressure
(evictions, retractions, readmissions) with random drafts: afterwards every page and every tree
lock is back, and the tokens equal those of the same requests decoded without drafts."""

from __future__ import annotations

import random

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.speculate import Speculator
from tests.fakes.fake_device import FakeDeviceRunner
from tests.spec_rig import Rig, ScriptedDrafter

VOCAB, PAGE, WINDOW, K = 48, 16, 31, 8


def _rig(spec: Speculator | None) -> Rig:
    runner = FakeDeviceRunner(0.0, vocab=VOCAB, page_size=PAGE, window=WINDOW, lookahead=K,
                              read_pages=False)
    # a full pool far below the batch's needs: the tree evicts and the stepper retracts
    return Rig(runner, spec=spec, page_size=PAGE, window=WINDOW, num_rows=56, full_pages=400,
               swa_pages=280, radix=True)


def _requests(rng: random.Random) -> list[tuple[str, list[int], SamplingParams]]:
    shared = [rng.randrange(2, VOCAB) for _ in range(40)]  # a common prefix the tree keeps
    out = []
    for i in range(56):
        own = [rng.randrange(2, VOCAB) for _ in range(rng.choice([1, 9, 16, 33, 70]))]
        params = SamplingParams(max_new_tokens=rng.randrange(300, 1200), temperature=0,
                                stop_token_ids=[1] if i % 3 == 0 else [], ignore_eos=True)
        out.append((f"r{i}", (shared if i % 2 else []) + own, params))
    return out


def test_ten_thousand_random_verify_steps_leak_nothing() -> None:
    rng = random.Random(7)
    reqs = _requests(rng)
    ref_rig = _rig(None)
    for rid, prompt, params in reqs:
        ref_rig.add(rid, prompt, 5, params)
    ref = {rid: list(v) for rid, v in ref_rig.run().items()}

    def draft(rid: str, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - len(dict((r, p) for r, p, _ in reqs)[rid])
        truth = ref[rid][done:done + k]
        cut = rng.randrange(len(truth) + 1)  # right up to a random point, then noise
        return truth[:cut] + [rng.randrange(VOCAB) for _ in range(rng.randrange(k + 2))]

    spec = Speculator(ScriptedDrafter(draft), K, None)
    rig = _rig(spec)
    for rid, prompt, params in reqs:
        rig.add(rid, prompt, 5, params)
    got = {rid: list(v) for rid, v in rig.run(max_steps=20_000).items()}
    assert got == ref
    rig.check_pages()
    st, ctx = spec.stats, rig.ctx
    verified = len(st.accept_lengths)  # one per request per verify step
    assert verified >= 10_000 and st.accepted_total > 0, verified
    assert ctx.stats.retractions_total > 0 and ctx.stats.evicted_full_pages_total > 0
    assert rig.stepper.generated_tokens_total == sum(len(v) for v in got.values())
