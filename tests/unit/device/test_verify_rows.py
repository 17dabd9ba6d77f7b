"""A verify step (one request in several consecutive entries of `decode_rows`, its input token
then its drafts) gives each entry the logits sequential decode steps give that position, and a
rejected draft's K/V is never seen afterwards: across page edges, past the SWA window, with the
ring widened by the lookahead, eager and through the graph path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode_worker.device.cuda_graph import FakeGraphBackend
from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.utils.mathx import cdiv

PAGE, K = 16, 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> GptOssModel:
    return load_model(write_model(tmp_path_factory.mktemp("m"), seed=0), "cpu", torch.float32)


class Request:
    """One request on its own pages, with a persistent row of decode inputs."""

    def __init__(self, runner: ModelRunner, prompt: list[int], first_page: int, steps: int):
        self.runner, self.inputs = runner, runner.new_inputs(1)
        self.row = self.inputs.acquire()
        self.pages = list(range(first_page, first_page + cdiv(len(prompt) + steps + K, PAGE)))
        self.seq = [*prompt, int(runner.prefill(prompt, self.pages, self.pages).argmax())]
        self.inputs.write_full(self.row, 0, self.pages)
        self.inputs.write_swa(self.row, 0, self.pages)  # the ring keeps the last pages
        self.inputs.write_token(self.row, self.seq[-1])

    def verify(self, drafts: list[int]) -> torch.Tensor:
        """Its input token then `drafts` at the next positions: [1 + k, V] logits."""
        pos = len(self.seq) - 1
        n = 1 + len(drafts)
        self.inputs.write_swa(self.row, 0, self.pages[:(pos + n - 1) // PAGE + 1])
        rows, positions = [self.row] * n, list(range(pos, pos + n))
        idx = np.arange(1, n, dtype=np.int64)
        logits, _ = self.runner.decode_rows(self.inputs, rows, positions,
                                            (idx, np.asarray(drafts, np.int64)))
        return logits.clone()

    def commit(self, tokens: list[int]) -> None:
        self.seq += tokens
        self.inputs.write_token(self.row, self.seq[-1])


def runner_for(model: GptOssModel, graphs: bool, backend: str = "torch") -> ModelRunner:
    pools = KVPools(KVSpec.from_config(model.cfg), 96, 96, PAGE, "cpu", torch.float32)
    return ModelRunner(model, pools, use_cuda_graph=graphs, graph_batch_sizes=[1, 2, 4, 8],
                       max_graph_pages=32, lookahead=K, attention_backend=backend,
                       graph_backend=FakeGraphBackend() if graphs else None)


def sequential(model: GptOssModel, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each step's logits, one token per step ([steps, V])."""
    req = Request(runner_for(model, False), prompt, 1, steps)
    out = []
    for _ in range(steps):
        logits = req.verify([])[0]
        out.append(logits)
        req.commit([int(logits.argmax())])
    return req.seq[len(prompt):], torch.stack(out)


@pytest.mark.parametrize(("graphs", "backend"), [(False, "torch"), (True, "torch"),
                                                 (True, "triton")])
def test_verify_entries_match_sequential_steps_and_rejected_drafts_stay_unseen(
        model: GptOssModel, graphs: bool, backend: str) -> None:
    """The reference runs torch eager; the Triton kernels run under the interpreter on CPU."""
    prompt = [(i * 37 + 11) % 250 + 3 for i in range(150)]  # past the 127-token window
    steps = 24
    tokens, ref = sequential(model, prompt, steps)  # tokens[0] came from prefill
    req = Request(runner_for(model, graphs, backend), prompt, 1, steps)
    done = 0  # decode steps of the reference covered
    plan = [(K, K), (3, 1), (K, 0), (2, 2), (4, 3), (K, K)]  # (drafts, of them right)
    for k, right in plan:
        drafts = tokens[done + 1:done + 1 + right] + [(t * 7 + 1) % 200 + 3 for t in
                                                      range(k - right)]
        drafts = [d if i < right or d != tokens[done + 1 + i] else (d + 1) % 250
                  for i, d in enumerate(drafts)]  # a wrong draft is really wrong
        logits = req.verify(drafts)
        for i in range(right + 1):  # the right drafts' entries, and the one after them
            torch.testing.assert_close(logits[i], ref[done + i], atol=1e-4, rtol=0)
        req.commit(tokens[done + 1:done + 2 + right])  # accepted drafts + the bonus
        done += right + 1
    assert req.seq[len(prompt):] == tokens[:done + 1]
