"""Sampler: greedy path, filters, per-request seeds, logprobs."""

from __future__ import annotations

import math

import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.device.sampler import Sampler, SampleRow, seeded_noise

GREEDY = SamplingParams(temperature=0.0)


def logits_batch(bs: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_batch_is_argmax() -> None:
    logits = logits_batch()
    out = Sampler(seed=0).sample(logits, [SampleRow(GREEDY)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_top_k_one_and_greedy_rows_inside_a_sampled_batch_are_argmax() -> None:
    logits = logits_batch()
    rows = [SampleRow(GREEDY), SampleRow(SamplingParams(top_k=1)),
            SampleRow(SamplingParams(temperature=1.0)), SampleRow(GREEDY)]
    out = Sampler(seed=0).sample(logits, rows)
    arg = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 1, 3)] == [arg[i] for i in (0, 1, 3)]


def test_seeded_row_is_reproducible_whatever_the_batch() -> None:
    logits = logits_batch(bs=3)
    row = SampleRow(SamplingParams(temperature=1.0, seed=42), step=7)
    other = SampleRow(SamplingParams(temperature=1.0))
    a = Sampler(seed=1).sample(logits, [row, other, other]).token_ids[0]
    b = Sampler(seed=2).sample(logits[[0, 2, 1]], [row, other, other]).token_ids[0]
    c = Sampler(seed=3).sample(logits[:1], [row]).token_ids[0]
    assert a == b == c
    filtered = SampleRow(SamplingParams(temperature=1.0, top_k=5))
    d = Sampler(seed=4).sample(logits, [row, filtered, other]).token_ids[0]  # sorted path
    assert d == a
    steps = {Sampler().sample(logits[:1], [SampleRow(row.params, step=s)]).token_ids[0]
             for s in range(30)}
    assert len(steps) > 1  # the step moves the seeded stream


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    vocab = 20
    logits = torch.linspace(4, 0, vocab)[None].repeat(64, 1)  # token 0 most likely
    probs = torch.softmax(logits[0], -1)
    sampler = Sampler(seed=0)
    cases = [(SamplingParams(top_k=3), set(range(3))),
             (SamplingParams(top_p=float(probs[:2].sum()) - 1e-4), set(range(2))),
             (SamplingParams(min_p=float(probs[4] / probs[0]) - 1e-4), set(range(5)))]
    for params, allowed in cases:
        seen = set(sampler.sample(logits, [SampleRow(params)] * 64).token_ids)
        assert seen <= allowed and len(seen) > 1, (params, seen)


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    tokens = torch.tensor(Sampler(seed=0).sample(logits, [SampleRow(params)] * 4000).token_ids)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    hot = Sampler(seed=0).sample(logits, [SampleRow(SamplingParams(temperature=100.0))] * 4000)
    hot_freq = torch.bincount(torch.tensor(hot.token_ids), minlength=3).float() / 4000
    assert hot_freq.min() > 0.3  # near uniform


def test_logprob_of_chosen_token_on_request() -> None:
    logits = logits_batch(bs=2)
    rows = [SampleRow(GREEDY, return_logprob=True), SampleRow(GREEDY)]
    out = Sampler().sample(logits, rows)
    expected = torch.log_softmax(logits[0], -1)[out.token_ids[0]].item()
    assert out.logprobs[1] is None
    assert math.isclose(out.logprobs[0] or 0.0, expected, rel_tol=1e-6)


def test_top_logprobs_are_the_most_likely_tokens_of_the_raw_distribution() -> None:
    logits = logits_batch(bs=3)
    rows = [SampleRow(GREEDY, top_logprobs=3),
            SampleRow(SamplingParams(temperature=0.7, seed=1), return_logprob=True,
                      top_logprobs=5),
            SampleRow(GREEDY, return_logprob=True)]
    out = Sampler(seed=0).sample(logits, rows)
    assert out.logprobs[0] is None and out.top_logprobs[2] is None  # only what was asked
    for i, n in ((0, 3), (1, 5)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == n
        ref_v, ref_i = torch.log_softmax(logits[i], -1).topk(n)  # before temperature
        assert [t for t, _ in top] == ref_i.tolist()
        assert all(math.isclose(lp, r, rel_tol=1e-6)
                   for (_, lp), r in zip(top, ref_v.tolist(), strict=True))
    top0 = out.top_logprobs[0]
    assert top0 is not None and top0[0][0] == out.token_ids[0]  # greedy picks the first


def test_top_logprobs_larger_than_the_vocabulary_return_all_of_it() -> None:
    out = Sampler().sample(logits_batch(bs=1, vocab=7), [SampleRow(GREEDY, top_logprobs=20)])
    top = out.top_logprobs[0]
    assert top is not None and sorted(t for t, _ in top) == list(range(7))
    assert math.isclose(sum(math.exp(lp) for _, lp in top), 1.0, rel_tol=1e-5)


def test_seeded_noise_samples_the_distribution_and_depends_only_on_its_key() -> None:
    """Seeded rows draw counter-based noise (a hash of the row's noise seed and the token id,
    no generator per row): Exp(1) in distribution, so the exponential race samples p; the same
    key gives the same noise in any batch; nearby keys (consecutive steps) are uncorrelated."""
    keys = torch.arange(20_000, dtype=torch.long) * 1_000_003 + 7  # [k] noise seeds
    noise = seeded_noise(keys, 4).double()  # [k, 4]
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    freq = torch.bincount((p / noise).argmax(dim=1), minlength=4).double() / len(keys)
    torch.testing.assert_close(freq, p, atol=0.015, rtol=0)
    wide = seeded_noise(torch.tensor([5, 6, 5], dtype=torch.long), 50_000).double()  # [3, V]
    assert torch.equal(wide[0], wide[2])
    assert abs(float(torch.corrcoef(wide[:2])[0, 1])) < 0.02
    assert abs(float(wide.mean()) - 1.0) < 0.02 and abs(float(wide.std()) - 1.0) < 0.02
