"""What the interop tests share: a `decode-worker serve` for SGLang prefills, the router's part
(the same room to the prefill harness and to the worker) and the check against transformers."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.e2e.conftest import assert_top_logprobs_match
from tests.e2e.driver import wait_idle
from tests.e2e.live_fixtures import SMALL_POOLS, Live, gen_body, pool_is_whole
from tests.interop.sglang_peer import SglangPrefill, venv_python
from tests.oracle.helpers import reference_greedy

PAGE_SIZE = 16  # prefill page size = the worker's
MAX_NEW = 8
TOP_LOGPROBS = 5  # the first token's alternatives come through SGLang's aux row
LOGPROB_TOL = 1e-4  # float32 on both sides; misplaced KV moves logprobs far past this
PEER_DEAD_AFTER_S = 3.0
PYTHON = venv_python()  # the SGLang venv's interpreter, None where it is missing
needs_sglang_venv = pytest.mark.skipif(PYTHON is None, reason="no SGLang venv "
                                       "(.venv-sglang/bin/python); bash scripts/setup_sglang.sh "
                                       "builds it")


def worker_args(model_dir: Path, port: int, protocol: str = "auto") -> list[str]:
    """`decode-worker serve` on `port`, page 16, `transfer.peer_protocol=protocol`."""
    # abort_quiesce_s: pages of a transfer the dead prefill never acked wait this long
    sets = {"cache.page_size": PAGE_SIZE, "transfer.peer_protocol": protocol,
            "transfer.peer_dead_after_s": PEER_DEAD_AFTER_S, "transfer.abort_quiesce_s": 2,
            "scheduler.kv_timeout_s": 15}
    return ["serve", "--model", str(model_dir), "--port", str(port), *SMALL_POOLS,
            *[x for key, value in sets.items() for x in ("--set", f"{key}={value}")]]


def conversation(seed: int, turns: int = 3) -> list[list[int]]:
    """New user tokens per turn: a 150-token system prompt (longer than the window + a page)
    and a short message first, then short messages of 5-40 tokens."""
    rng = random.Random(seed)
    msgs = [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 41))] for _ in range(turns)]
    return [[rng.randrange(3, 250) for _ in range(150)] + msgs[0], *msgs[1:]]


def pd_body(harness: SglangPrefill, input_ids: list[int], room: int) -> dict[str, Any]:
    """The worker's /generate body for `room` at `harness` (greedy, logprobs, top logprobs)."""
    return gen_body(input_ids, MAX_NEW, return_logprob=True, top_logprobs_num=TOP_LOGPROBS,
                    bootstrap_host="127.0.0.1", bootstrap_port=harness.ports.bootstrap,
                    bootstrap_room=room)


def pd_request(harness: SglangPrefill, worker: Live, input_ids: list[int],
               **prefill: Any) -> tuple[httpx.Response, dict[str, Any]]:
    """What the router does: the same room to the prefill and the worker, concurrently.
    Returns the worker's answer and the room's final state on the prefill side."""
    room = random.getrandbits(63)
    spec = {"room": room, "input_ids": input_ids, "kv": "model", "return_logprob": True,
            "top_logprobs_num": TOP_LOGPROBS, "timeout_s": 30, **prefill}
    with ThreadPoolExecutor(max_workers=1) as pool:
        pre = pool.submit(harness.prefill, spec)
        resp = worker.post("/generate", pd_body(harness, input_ids, room), timeout_s=40)
        pre.result(timeout=30)
    # a room the worker failed may never end on the prefill side (no TransferInfo came)
    return resp, harness.wait_room(room, timeout_s=15 if resp.status_code == 200 else 5)


def check_against_reference(reference: Any, prompt: list[int], out: dict[str, Any]) -> None:
    """Greedy tokens, logprobs and top logprobs equal transformers' (`reference`, float32)."""
    tokens, logits = reference_greedy(reference, prompt, MAX_NEW)  # [steps, V] f32
    lps = torch.log_softmax(logits, dim=-1)  # [steps, V]
    meta = out["meta_info"]
    assert out["output_ids"] == tokens, "tokens differ from transformers'"
    got = meta["output_token_logprobs"]
    assert [t for _, t, _ in got] == tokens
    worst = max(abs(lp - float(lps[i, t])) for i, (lp, t, _) in enumerate(got))
    assert worst < LOGPROB_TOL, f"logprobs off by {worst:.2e}"
    assert_top_logprobs_match(meta["output_top_logprobs"], list(lps), TOP_LOGPROBS, LOGPROB_TOL)
    assert meta["prompt_tokens"] == len(prompt)


def assert_idle_and_whole(worker: Live, timeout_s: float = 15.0) -> None:
    """/get_load shows nothing running or waiting, and every page is back (pool gauges)."""
    wait_idle(worker.url, timeout_s)
    deadline = time.monotonic() + timeout_s
    while problems := pool_is_whole(worker.wait_idle(timeout_s)):
        assert time.monotonic() < deadline, f"pages not back: {problems}"
        time.sleep(0.1)
