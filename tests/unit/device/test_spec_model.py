"""Speculation on against off on the real (tiny, random) gpt-oss: greedy tokens identical, each
token's logprob within 1e-3 of decoding without drafts, and every page back, with drafts right,
wrong and partly right, across page edges and past the 127-token window; the torch path and the
Triton kernels (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.speculate import Speculator
from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from tests.spec_rig import Rig
from tests.unit.test_spec_equality import _drafter

PAGE, K = 16, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GptOssModel:
    return load_model(write_model(tmp_path_factory.mktemp("m"), seed=0), "cpu", torch.float32)


def _run(model: GptOssModel, backend: str, prompts: dict[str, list[int]], max_new: int,
         spec: Speculator | None, logprobs: list[list[float]] | None = None
         ) -> dict[str, list[int]]:
    pools = KVPools(KVSpec.from_config(model.cfg), 160, 120, PAGE, "cpu", torch.float32)
    runner = ModelRunner(model, pools, use_cuda_graph=False, graph_batch_sizes=[1],
                         attention_backend=backend, lookahead=K)
    rig = Rig(runner, spec=spec, page_size=PAGE, window=model.cfg.window, num_rows=4,
              full_pages=160, swa_pages=120)
    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    lives = [rig.add(rid, prompt, None, params, return_logprob=True, top_logprobs=2)
             for rid, prompt in prompts.items()]
    out = {rid: list(v) for rid, v in rig.run().items()}
    rig.check_pages()
    if logprobs is not None:
        logprobs += [lv.logprobs for lv in lives]
    return out


@pytest.mark.parametrize(("backend", "lengths", "max_new"), [
    ("torch", (5, 60, 140), 24), ("triton", (17, 130), 10)])
def test_greedy_tokens_are_identical_with_drafts(model: GptOssModel, backend: str,
                                                 lengths: tuple[int, ...], max_new: int) -> None:
    prompts = {f"r{i}": [(i * 31 + j * 11) % 250 + 3 for j in range(n)]
               for i, n in enumerate(lengths)}
    ref_lp: list[list[float]] = []
    got_lp: list[list[float]] = []
    ref = _run(model, backend, prompts, max_new, None, ref_lp)
    modes = dict(zip(prompts, ("right", "partly", "wrong"), strict=False))
    spec = Speculator(_drafter(ref, prompts, modes, seed=3), K, None)
    assert _run(model, backend, prompts, max_new, spec, got_lp) == ref
    # each token's logprob is what decoding without drafts gave it
    for a, b in zip(got_lp, ref_lp, strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-3
    assert spec.stats.accepted_total > 0 and spec.stats.verify_steps_total > 0
