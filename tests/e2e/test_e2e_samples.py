"""n > 1 and prompt batches across P/D: prefill peer -> NIXL -> decode worker as real processes,
with the router's array bootstrap fields (one room per sample), against the reference tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from decode_worker.daemon.shared.procs import http_json
from tests.e2e import driver

pytestmark = pytest.mark.slow
MAX_NEW = 6


def _router_fields(boot_port: int, num_samples: int) -> dict[str, Any]:
    """What sglang-router adds for a body with n > 1 or an array prompt."""
    return {"bootstrap_host": ["127.0.0.1"] * num_samples,
            "bootstrap_port": [boot_port] * num_samples,
            "bootstrap_room": [random.getrandbits(63) for _ in range(num_samples)]}


def _both(workers: driver.Workers, path: str, body: dict[str, Any]) -> Any:
    with ThreadPoolExecutor(1) as pool:
        pre = pool.submit(http_json, f"{workers.prefill.url}{path}", body)
        out = http_json(f"{workers.decode.url}{path}", body)
        pre.result()
    return out


def _requests_ended(workers: driver.Workers) -> float:
    metrics = driver.get_text(f"{workers.decode.url}/metrics").splitlines()
    ended = [ln for ln in metrics if ln.startswith("decode_worker_requests_total{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in ended)


@pytest.mark.parametrize("protocol", ["native", "sglang"])
def test_batch_of_prompts_times_n_matches_reference_per_sample(
        plain_pd: Callable[[str], driver.Workers], reference_run: Any, protocol: str) -> None:
    prompts = driver.conversation(2, seed=3)[:2]
    workers = plain_pd(protocol)
    ended_before = _requests_ended(workers)
    body = {"input_ids": prompts, "sampling_params": {
        "n": 2, "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
        **_router_fields(workers.boot_port, 4)}
    out = _both(workers, "/generate", body)
    assert len(out) == 4
    for k, sample in enumerate(out):
        want, _ = reference_run(prompts[k // 2], MAX_NEW)
        assert sample["output_ids"] == want, f"sample {k}"
    assert _requests_ended(workers) - ended_before == 4
    chat = {"messages": [{"role": "user", "content": "two answers"}], "n": 2,
            "max_tokens": MAX_NEW, "temperature": 1.0, "seed": 5,
            **_router_fields(workers.boot_port, 2)}
    choices = _both(workers, "/v1/chat/completions", chat)["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["finish_reason"] in ("length", "stop") for c in choices)
