"""End-to-end fixtures: the tiny model on disk and the reference implementation's tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from decode_worker.daemon.shared.router import has_router
from decode_worker.device.default_model import write_model
from tests.e2e.driver import Workers
from tests.e2e.live_fixtures import Live, live_server


@pytest.fixture(scope="session")
def e2e_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("e2e") / "tiny-gpt-oss", seed=0)


# The shared servers are package-scoped: stopped when the run leaves tests/e2e (an idle server
# still polls: kept to the session's end, they cost minutes of CPU over the rest of the suite).
# Under pytest-xdist, tests/conftest.py sends the files that use one to a single worker, where
# they run one after the other.
@pytest.fixture(scope="package")
def plain_live(e2e_model_dir: Path) -> Iterator[Live]:
    """One `decode-worker serve` with the small pools and default settings, shared by the
    live API, admin, lifecycle and dashboard tests (each start costs seconds). Tests on it
    change no setting, stop nothing and leave it idle; they count with deltas."""
    with live_server(e2e_model_dir, name="plain") as live:
        yield live


@pytest.fixture(scope="package")
def plain_pd(e2e_model_dir: Path) -> Iterator[Callable[[str], Workers]]:
    """protocol ("native" or "sglang") -> a prefill peer of that protocol and a decode worker,
    default settings, no router; started on first use and shared by the e2e tests (each start
    costs seconds). Tests on it change no setting and kill nothing; they count with deltas
    and use fresh rooms."""
    started: dict[str, Workers] = {}

    def get(protocol: str) -> Workers:
        if protocol not in started:
            started[protocol] = Workers(e2e_model_dir, router=False, extra=[],
                                        protocol=protocol).__enter__()
        return started[protocol]

    try:
        yield get
    finally:
        for workers in started.values():
            workers.__exit__(None, None, None)


@pytest.fixture(scope="package")
def plain_routed(e2e_model_dir: Path) -> Iterator[Workers]:
    """A native prefill peer and a decode worker, default settings, behind smg (PD mode) when
    it is installed (`router` is None without it); shared by the OpenAI SDK and Responses API
    tests, which send only fresh requests and count nothing."""
    with Workers(e2e_model_dir, router=has_router(), extra=[]) as workers:
        yield workers


@pytest.fixture(scope="session")
def reference_run(e2e_model_dir: Path):  # type: ignore[no-untyped-def]
    """input_ids, max_new -> the reference implementation's greedy output ids and, per output
    token, the log-softmax of its raw logits ([V] float32)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.GptOssForCausalLM.from_pretrained(e2e_model_dir, dtype=torch.float32)
    model.eval()

    def run(input_ids: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
        ids = torch.tensor([input_ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, min_new_tokens=max_new,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = [int(t) for t in out.sequences[0, len(input_ids):]]
        return tokens, [torch.log_softmax(step[0].float(), -1) for step in out.logits]

    return run


@pytest.fixture(scope="session")
def reference_greedy(reference_run):  # type: ignore[no-untyped-def]
    """input_ids, max_new -> the reference's greedy output ids and their logprobs (float32)."""

    def generate(input_ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
        tokens, lps = reference_run(input_ids, max_new)
        return tokens, [float(lp[t]) for lp, t in zip(lps, tokens, strict=True)]

    return generate


def assert_top_logprobs_match(got: list[list[list[float]]], want: list[torch.Tensor], n: int,
                       tol: float) -> None:
    """SGLang's `output_top_logprobs` against the reference's per-token log-softmax: the same
    n token ids in the same order, logprobs within `tol`."""
    assert len(got) == len(want)
    for i, (top, lp) in enumerate(zip(got, want, strict=True)):
        ref_v, ref_i = lp.topk(n)
        assert [int(t) for _, t, _ in top] == ref_i.tolist(), f"token {i}: other alternatives"
        worst = max(abs(v - r) for (v, _, _), r in zip(top, ref_v.tolist(), strict=True))
        assert worst < tol, f"token {i}: top logprobs off by {worst:.2e}"
