"""Which drafts a verify step keeps: greedy exactly as without drafts, sampled so that the
tokens' joint law is the target's (a chi-square test that a deliberately biased rule fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode_worker.device import spec_accept
from decode_worker.device.sampler import ParamsBatch
from decode_worker.device.spec_accept import Drafts, accept

V = 4
# the "model": logits of the next token given the previous one (a 4-token Markov chain)
TABLE = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.0, 1.5, 1.0, -2.0],
                      [-1.0, 0.0, 0.3, 1.2], [1.0, -0.5, 0.0, 0.8]])
CHI2_15_1E6 = 56.49  # chi-square critical value, 15 degrees of freedom, p = 1e-6


def params(n: int, temperature: float, top_k: int = 0, greedy: bool = False) -> ParamsBatch:
    cols = np.tile([1.0 if greedy else temperature, top_k, 1.0, 0.0, float(greedy)], (n, 1))
    return ParamsBatch.of_columns(cols, V, torch.device("cpu"), [])


def target_law(temperature: float, top_k: int) -> torch.Tensor:
    """p(t) for each previous token: [V, V] after temperature and top-k."""
    probs = torch.softmax(TABLE / temperature, dim=-1)
    if top_k:
        low = probs < probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(low, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def two_tokens(n: int, k: int, temperature: float, top_k: int, seed: int) -> np.ndarray:
    """n independent requests (previous token 0) decode two tokens by verify steps with random
    drafts of k tokens each step: [n, 2] the first two committed tokens."""
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    seqs = [[0] for _ in range(n)]
    while any(len(s) < 3 for s in seqs):
        todo = [s for s in seqs if len(s) < 3]
        drafts = [rng.integers(0, V, k).tolist() for _ in todo]
        logits = torch.cat([TABLE[[s[-1], *d]] for s, d in zip(todo, drafts, strict=True)])
        plan = Drafts.of(drafts)
        runs = accept(logits, params(plan.num_entries, temperature, top_k), plan, gen)
        for s, run in zip(todo, runs, strict=True):
            assert 1 <= len(run) <= k + 1
            s += run
    return np.array([s[1:3] for s in seqs])


def chi_square(pairs: np.ndarray, temperature: float, top_k: int) -> float:
    law = target_law(temperature, top_k)
    expected = (law[0][:, None] * law).numpy().ravel() * len(pairs)  # p(t1) p(t2 | t1)
    seen = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    cells = expected > 0
    assert not seen[~cells].any(), "a token the filters remove was committed"
    return float(((seen[cells] - expected[cells]) ** 2 / expected[cells]).sum())


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 3)])
def test_sampled_tokens_follow_the_targets_joint_law(temperature: float, top_k: int) -> None:
    pairs = two_tokens(6000, 2, temperature, top_k, seed=1)
    assert chi_square(pairs, temperature, top_k) < CHI2_15_1E6


def test_a_biased_acceptance_rule_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping every first draft (whatever its probability) is visibly biased."""
    first_refusal = spec_accept._first_refusal

    def keep_first(kept: np.ndarray, ks: np.ndarray) -> np.ndarray:
        kept = kept.copy()
        kept[np.cumsum(ks) - ks] = True
        return first_refusal(kept, ks)

    monkeypatch.setattr(spec_accept, "_first_refusal", keep_first)
    pairs = two_tokens(6000, 2, 1.0, 0, seed=1)
    assert chi_square(pairs, 1.0, 0) > 10 * CHI2_15_1E6


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    """The argmax after 0 is 0, after 1 is 1, after 2 is 3: entries hold the logits after the
    request's previous token, then after each of its drafts."""
    logits = torch.cat([TABLE[[0, 0, 0, 1]], TABLE[[1, 1, 1]], TABLE[[2]]])
    plan = Drafts.of([[0, 0, 1], [1, 1], []])  # refused at the third; all kept; none
    runs = accept(logits, params(plan.num_entries, 1.0, greedy=True), plan,
                  torch.Generator().manual_seed(0))
    assert runs == [[0, 0, 0], [1, 1, 1], [3]]
