"""Speculative decoding behind the gateway: a decode worker speculating (NGRAM) beside a stock
prefill peer, fronted by smg over HTTP (P/D) and over smg's gRPC worker protocol; its greedy
tokens equal a worker without speculation's for the same prompts, through both doors."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.harmony_vocab import harmony_vocab_env
from decode_worker.daemon.shared.procs import PdServers, free_port, http_json, scrape_metric
from decode_worker.daemon.shared.router import SMG, Router, has_router, router_argv

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed"),
              pytest.mark.skipif(not harmony_vocab_env(), reason="no o200k vocabulary for smg's "
                                 "harmony encoding (quicktok-v1 not installed)")]
SPEC = ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6"]
LOOP = [17, 42, 99, 5, 23, 61, 8, 77]


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [LOOP * 5 + [rng.randrange(3, 250) for _ in range(n)] for n in (3, 20)]


def _gen(ids: list[int]) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def servers(e2e_model_dir: Path) -> Iterator[tuple[PdServers, Router, Router]]:
    common = ["--model", str(e2e_model_dir), "--set", "cache.page_size=16"]
    with PdServers(common, grpc=True, decode_args=SPEC) as pd:
        http_port, grpc_port = free_port(), free_port()
        http = Router(router_argv(SMG, [(pd.prefill.url, pd.boot_port)], [pd.decodes[0].url],
                                  http_port), http_port)
        grpc = Router(router_argv(SMG, [(f"grpc://{pd.prefill.grpc_target}", pd.boot_port)],
                                  [f"grpc://{pd.decodes[0].grpc_target}"], grpc_port), grpc_port)
        with http, grpc:
            http.wait_workers(2, 90)
            grpc.wait_workers(2, 90)
            yield pd, http, grpc


def _plain(plain_pd: Any, ids: list[int]) -> list[int]:
    workers = plain_pd("native")
    with ThreadPoolExecutor(2) as pool:
        return list(workers.generate(pool, ids, 32)["output_ids"])


def test_greedy_tokens_through_smg_http_and_grpc_equal_no_speculation(
        servers: tuple[PdServers, Router, Router], plain_pd: Any, e2e_model_dir: Path) -> None:
    pd, http, grpc = servers
    before = scrape_metric(pd.decodes[0].url, "decode_worker_spec_accepted_tokens_total")
    for ids in _prompts():
        want = _plain(plain_pd, ids)
        over_http = http_json(f"{http.url}/generate", _gen(ids))
        over_grpc = http_json(f"{grpc.url}/generate", {"model": str(e2e_model_dir), **_gen(ids)})
        over_grpc = over_grpc[0] if isinstance(over_grpc, list) else over_grpc
        assert over_http["output_ids"] == want and over_grpc["output_ids"] == want
    after = scrape_metric(pd.decodes[0].url, "decode_worker_spec_accepted_tokens_total")
    assert after > before  # the repeated phrase was drafted and kept
