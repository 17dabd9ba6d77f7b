"""smg 1.13 in gRPC P/D mode (`grpc://` worker URLs) in front of the reference prefill peer and
a decode worker: the gateway's own path to the workers, token-exact against the HTTP path.

Real processes: the prefill peer and the decode worker serve HTTP and `--grpc-port`; smg
(`python -m smg.launch_router`) gets only the gRPC addresses, tokenizes and detokenizes
itself and sends `Generate` with token ids and the bootstrap fields to both. Checked:
`/generate` (plain, streamed, n > 1) and `/v1/completions` give the ids and text the HTTP
path gives for the same prompt; a later turn reuses the earlier turn's KV (`cached_tokens`);
a client that leaves mid-stream has its request aborted and every page returned; smg asks
the decode worker for its KV events.

Chat and Responses: smg renders gpt-oss prompts with its harmony builder, whose token ids are
the o200k_harmony vocabulary's; the tiny model's vocabulary is 264 byte-level ids, so the
worker refuses them (INVALID_ARGUMENT naming the id) and smg answers 400. Generation on
smg's harmony path runs in `test_grpc_smg_chat.py`, on a tiny model in the o200k id space.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.harmony_vocab import harmony_vocab_env
from decode_worker.daemon.shared.procs import PdServers, free_port, http_json, scrape_metric
from decode_worker.daemon.shared.router import SMG, Router, has_router, router_argv
from tests.e2e.live_fixtures import idle_metrics, pool_is_whole

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed"),
              pytest.mark.skipif(not harmony_vocab_env(), reason="no o200k vocabulary for smg's "
                                 "harmony encoding (quicktok-v1 not installed)")]
PROMPT = [random.Random(5).randrange(3, 250) for _ in range(70)]


class Stack:
    def __init__(self, servers: PdServers, router: Router, model: str) -> None:
        self.servers, self.router, self.model = servers, router, model
        self.decode = servers.decodes[0]

    def http_pd(self, path: str, body: dict[str, Any]) -> Any:
        """The HTTP path: the same body to the prefill peer and the decode worker."""
        body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.servers.boot_port,
                "bootstrap_room": random.getrandbits(62)}
        with ThreadPoolExecutor(1) as pool:
            pre = pool.submit(http_json, f"{self.servers.prefill.url}{path}", body)
            out = http_json(f"{self.decode.url}{path}", body)
            pre.result(60)
        return out

    def smg(self, path: str, body: dict[str, Any]) -> Any:
        return http_json(f"{self.router.url}{path}", {"model": self.model, **body})


@pytest.fixture(scope="module")
def stack(e2e_model_dir: Path) -> Iterator[Stack]:
    common = ["--model", str(e2e_model_dir), "--set", "cache.page_size=16",
              "--set", "cache.num_full_pages=512", "--set", "cache.num_swa_pages=128"]
    # no --kv-events-config: with the gRPC port on, SubscribeKvEvents serves the in-process log
    with PdServers(common, grpc=True) as servers:
        port = free_port()
        argv = router_argv(SMG, [(f"grpc://{servers.prefill.grpc_target}", servers.boot_port)],
                           [f"grpc://{servers.decodes[0].grpc_target}"], port,
                           policy="cache_aware")
        router = Router(argv, port)
        with router:
            router.wait_workers(2, 90)
            yield Stack(servers, router, str(e2e_model_dir))
        router.stop()


def _gen(ids: list[int], max_new: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, **extra}


def _first(answer: Any) -> dict[str, Any]:
    return dict(answer[0] if isinstance(answer, list) else answer)


def test_generate_is_token_exact_against_the_http_path(stack: Stack) -> None:
    http = stack.http_pd("/generate", _gen(PROMPT, 8, return_logprob=True))
    grpc = _first(stack.smg("/generate", _gen(PROMPT, 8, return_logprob=True)))
    assert grpc["output_ids"] == http["output_ids"] and len(http["output_ids"]) == 8
    assert grpc["meta_info"]["finish_reason"]["type"] == "length"
    got = [lp for lp, _ in grpc["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _, _ in http["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_streamed_generate_and_n_samples(stack: Stack) -> None:
    http = stack.http_pd("/generate", _gen(PROMPT, 6))
    events = _sse(f"{stack.router.url}/generate",
                  {"model": stack.model, **_gen(PROMPT, 6, stream=True)})
    streamed = [e for e in events if e["meta_info"]["finish_reason"] is None]
    # smg's final event repeats the last id beside the finish reason (as with SGLang)
    assert [t for e in streamed for t in e["output_ids"]] == http["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    body = _gen(PROMPT, 6)
    body["sampling_params"]["n"] = 2
    both = stack.smg("/generate", body)
    assert [a["output_ids"] for a in both] == [http["output_ids"]] * 2  # greedy: the same


def test_completions_text_matches_the_http_path(stack: Stack) -> None:
    body = {"prompt": "The decode worker", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    http = stack.http_pd("/v1/completions", body)
    grpc = stack.smg("/v1/completions", body)
    assert grpc["choices"][0]["text"] == http["choices"][0]["text"]
    assert grpc["usage"]["completion_tokens"] == 8


def test_later_turn_reuses_the_earlier_turns_kv(stack: Stack) -> None:
    first = _first(stack.smg("/generate", _gen(PROMPT[:40] + [7] * 30, 6)))
    history = PROMPT[:40] + [7] * 30 + first["output_ids"] + [9] * 20
    second = _first(stack.smg("/generate", _gen(history, 6)))
    assert second["meta_info"]["cached_tokens"] >= 64  # whole pages of turn 1 stayed cached
    assert second["output_ids"] == stack.http_pd("/generate", _gen(history, 6))["output_ids"]


def test_client_that_leaves_mid_stream_frees_its_request(stack: Stack) -> None:
    before = scrape_metric(stack.decode.url, "decode_worker_aborts_total", 'reason="client_abort"')
    body = json.dumps({"model": stack.model, **_gen(PROMPT, 3000, stream=True)}).encode()
    req = urllib.request.Request(f"{stack.router.url}/generate", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        for _ in range(3):
            assert resp.readline()
    deadline = time.monotonic() + 30
    while scrape_metric(stack.decode.url, "decode_worker_aborts_total",
                        'reason="client_abort"') < before + 1:
        assert time.monotonic() < deadline, "the decode request was not aborted"
        time.sleep(0.1)
    m = idle_metrics(stack.decode.url)
    assert pool_is_whole(m) == []


def test_chat_on_smgs_harmony_path_is_refused_cleanly(stack: Stack) -> None:
    body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(urllib.request.Request(
            f"{stack.router.url}/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"}), timeout=60)
    assert info.value.code == 400
    assert "outside the vocabulary" in info.value.read().decode()
    assert pool_is_whole(idle_metrics(stack.decode.url)) == []


def test_a_body_without_model_is_404_model_not_found(stack: Stack) -> None:
    """smg's gRPC mode routes by model id (the first lines of DEPLOY.md's "smg in gRPC mode"):
    a body without "model" is 404 `model_not_found` for model 'unknown'; the id smg registered
    is the worker's served name, here its model path (no served name set)."""
    req = urllib.request.Request(f"{stack.router.url}/generate",
                                 json.dumps(_gen(PROMPT, 2)).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    body = info.value.read().decode()
    assert info.value.code == 404, body
    assert "model_not_found" in body and "No worker available for model 'unknown'" in body
    assert http_json(f"{stack.decode.url}/v1/models")["data"][0]["id"] == stack.model
    assert _first(stack.smg("/generate", _gen(PROMPT, 2)))["meta_info"]["finish_reason"]


def test_smg_subscribes_to_the_decode_workers_events(stack: Stack) -> None:
    """smg streams the decode worker's events, served by default from its in-process log (no
    ZMQ publisher configured); the prefill peer publishes none: it answers UNIMPLEMENTED, and
    smg stops asking it."""
    log = _plain(stack.router.output())
    assert "Starting KV event subscription worker_url=grpc://" + str(
        stack.decode.grpc_target) in log
    assert f"Backend does not implement SubscribeKvEvents, disabling KV event subscription " \
           f"for this worker; cache-aware routing sees nothing of its cache worker_url=grpc://" \
           f"{stack.servers.prefill.grpc_target}" in log
    decode_log = stack.decode.output()
    assert "SubscribeKvEvents: a subscriber from" in decode_log
    assert scrape_metric(stack.decode.url, "decode_worker_grpc_requests_total",
                         'method="SubscribeKvEvents",code="UNIMPLEMENTED"') == 0
    # smg's own metrics: it applied the decode worker's batches and their stored blocks
    cmd = stack.router.cmd
    smg_url = f"http://127.0.0.1:{cmd[cmd.index('--prometheus-port') + 1]}"
    worker = f'worker="grpc://{stack.decode.grpc_target}"'
    deadline = time.monotonic() + 20
    while scrape_metric(smg_url, "smg_kv_event_blocks_total", worker + ',op="stored"') < 1:
        assert time.monotonic() < deadline, "smg applied no stored block of the decode worker"
        time.sleep(0.2)
    assert scrape_metric(smg_url, "smg_kv_event_batches_total",
                         worker + ',disposition="applied"') >= 1


def _plain(text: str) -> str:
    import re
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events
