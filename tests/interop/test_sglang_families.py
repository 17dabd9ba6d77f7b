"""SGLang 0.5.23's own prefill classes feed a `decode-worker serve` of the new families.

The harness (tests/interop/sglang_prefill/, SGLang venv) lays a model out as SGLang does
(`layout.model_geometry`): Qwen3, a full-attention model, in one `MHATokenToKVPool` with no SWA
state, and Gemma 3 the same way, as an ordinary model (SGLang 0.5.23 keeps full KV in every
layer of it and masks the window). It runs transformers' real prefill of a tiny checkpoint
transformers wrote (tests/families.py) and SGLang's `NixlKVSender` writes the KV into the
worker; the test plays the router (tests/interop/pd.py).

Checked: a three-turn conversation of each family equals transformers' greedy tokens, logprobs
and top logprobs, later turns cached and the prefill told a decode prefix. Gemma 3 arrives in
SGLang's all-layer layout, lands in the worker's landing area and only the window of its
sliding layers is kept (docs/DEPLOY.md, "Gemma 3 and a stock SGLang prefill"): the bytes moved
are every layer's, and every landing page is back once idle.

Ports: 43500-43599 only (both harnesses' HTTP, ZMQ and UCX ranges, and the workers').
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.procs import ServerProcess, scrape_metric
from decode_worker.io.kv.sglang.prefill_plan import AUX_ROW_BYTES
from tests.e2e.live_fixtures import Live, Metrics
from tests.families import reference_model
from tests.interop.pd import (
    PAGE_SIZE,
    PYTHON,
    assert_idle_and_whole,
    check_against_reference,
    conversation,
    needs_sglang_venv,
    pd_request,
    worker_args,
)
from tests.interop.sglang_peer import HarnessPorts, SglangPrefill

pytestmark = [pytest.mark.slow, needs_sglang_venv]

# fixed ports below Linux's ephemeral range (32768-60999), where the OS never hands one out
# to another socket meanwhile
PORTS = {"qwen3": (HarnessPorts(18700, 18701, "18710-18719", "18720-18739"), 18790,
                   "18770-18779"),
         "gemma3": (HarnessPorts(18702, 18703, "18740-18749", "18750-18769"), 18791,
                    "18780-18789")}


@dataclass
class Pair:
    harness: SglangPrefill
    worker: Live
    reference: Any


@pytest.fixture(scope="module")
def pairs(family_dir: Callable[[str], Path]) -> Iterator[dict[str, Pair]]:
    """Per family a harness and a worker, all started at once (the harnesses import for
    10-25 s)."""
    assert PYTHON is not None
    started: list[tuple[SglangPrefill, ServerProcess]] = []
    dirs = {family: family_dir(family) for family in PORTS}
    for family, (ports, port, ucx) in PORTS.items():
        harness = SglangPrefill(PYTHON, ports, ["--model", str(dirs[family]), "--page-size",
                                                str(PAGE_SIZE)]).start()
        args = worker_args(dirs[family], port)
        if family == "qwen3":  # worker_args' small pools size an SWA pool Qwen3 does not have
            at = args.index("cache.num_swa_pages=128")
            args = args[:at - 1] + args[at + 1:]
        proc = ServerProcess(f"decode-{family}", args, port, env={"UCX_TCP_PORT_RANGE": ucx})
        started.append((harness, proc.__enter__()))
    try:
        out = {}
        for (harness, proc), family in zip(started, PORTS, strict=True):
            proc.wait_ready(120)
            harness.wait_ready()
            out[family] = Pair(harness, Live(proc), reference_model(dirs[family]))
        yield out
        for pair in out.values():
            pair.worker.close()
    finally:
        for harness, proc in started:
            harness.kill()
            proc.stop()


def chat(pair: Pair, seed: int) -> list[tuple[int, int]]:
    """A three-turn conversation through the pair, each turn checked against transformers, the
    later ones cached (the prefill told a decode prefix); (prompt length, cached) per turn."""
    history: list[int] = []
    turns, prefixes = [], []
    for turn, user in enumerate(conversation(seed=seed)):
        prompt = history + user
        resp, state = pd_request(pair.harness, pair.worker, prompt)
        assert resp.status_code == 200, f"turn {turn}: {resp.text[:2000]}"
        assert state["status"] == "success", f"turn {turn}: {state}\n" + (
            pair.harness.output()[-3000:])
        out = resp.json()
        check_against_reference(pair.reference, prompt, out)
        turns.append((len(prompt), out["meta_info"]["cached_tokens"]))
        prefixes.append(state["ranks"][0]["decode_prefix_len"])
        history = prompt + out["output_ids"]
    cached = [c for _, c in turns]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert prefixes == cached, (prefixes, cached)
    return turns


def test_qwen3_from_sglang_prefill_classes_matches_reference(pairs: dict[str, Pair]) -> None:
    chat(pairs["qwen3"], seed=7)
    assert_idle_and_whole(pairs["qwen3"].worker)


def test_gemma3_in_sglangs_all_layer_layout_lands_and_matches_reference(
        pairs: dict[str, Pair]) -> None:
    """Every layer's KV of each turn's new tokens moves (SGLang's layout: 4 layers x 2 KV
    heads x 16 dims x float32 x K and V = 1 KiB per token, the last page whole, plus the aux
    row), lands, and the window is copied into the SWA pool: the tokens are transformers'."""
    pair = pairs["gemma3"]
    before = scrape_metric(pair.worker.url, "decode_worker_transfer_bytes_total")
    turns = chat(pair, seed=8)
    moved = scrape_metric(pair.worker.url, "decode_worker_transfer_bytes_total") - before
    want = sum((-(-n // PAGE_SIZE) * PAGE_SIZE - c) * 1024 + AUX_ROW_BYTES for n, c in turns)
    assert moved == want, (moved, want, turns)
    landing = Metrics(pair.worker.get("/metrics").text).pool("landing")
    assert landing["total"] > 0, landing  # the landing area exists (and is all free: below)
    assert_idle_and_whole(pair.worker)
