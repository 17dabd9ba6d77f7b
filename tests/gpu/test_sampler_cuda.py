"""The sampler on CUDA: greedy is argmax, seeded rows reproduce (needs CUDA; auto-skipped)."""

from __future__ import annotations

import pytest
import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.device.sampler import Sampler, SampleRow

pytestmark = pytest.mark.gpu


def test_cuda_sampler_greedy_and_seeded() -> None:
    logits = torch.randn(4, 1000, device="cuda")
    sampler = Sampler("cuda", seed=0)
    greedy = sampler.sample(logits, [SampleRow(SamplingParams(temperature=0.0))] * 4)
    assert greedy.token_ids == logits.argmax(-1).tolist()
    row = SampleRow(SamplingParams(temperature=0.8, top_p=0.9, seed=7), step=3,
                    return_logprob=True)
    a = sampler.sample(logits, [row] * 4)
    b = Sampler("cuda", seed=1).sample(logits, [row] * 4)
    assert a.token_ids == b.token_ids
    assert all(lp is not None and lp <= 0 for lp in a.logprobs)
