"""Chat and Responses on smg 1.13's own harmony pipeline in gRPC P/D mode.

smg picks its harmony pipeline for a worker whose model card says gpt-oss (architectures
`GptOssForCausalLM`, model type `gpt_oss`), whatever `--chat-template` says, and renders
prompts in the o200k_harmony ids. Here the workers serve a tiny gpt-oss in that id space
(`o200k_model.py`), so the whole path runs: smg's harmony builder renders the messages, the
reference prefill peer and the decode worker run them (gRPC `Generate` with the bootstrap
fields), smg's harmony parser reads the output, and its Responses history feeds a later turn
that reuses the decode worker's KV (`cached_tokens`). Checked: answers with the requested
token counts (plain, streamed, Responses), the gRPC calls counted, every page back.

Not verified here: the parsed text (random weights write no harmony channels, so smg returns
no content), reasoning and tool-call parsing, and token equality with the worker's own HTTP
chat (this model's tokenizer renders text byte by byte, o200k merges it): those need gpt-oss
weights.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from decode_worker.daemon.shared.harmony_vocab import harmony_vocab_env
from decode_worker.daemon.shared.procs import PdServers, free_port, http_json, scrape_metric
from decode_worker.daemon.shared.router import SMG, Router, has_router, router_argv
from tests.e2e.live_fixtures import idle_metrics, pool_is_whole
from tests.e2e.o200k_model import write_o200k_model

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed"),
              pytest.mark.skipif(not harmony_vocab_env(), reason="no o200k vocabulary for smg's "
                                 "harmony encoding (quicktok-v1 not installed)")]
MESSAGES = [{"role": "user", "content": "What does a decode worker do?"}]


class Stack:
    def __init__(self, servers: PdServers, router: Router, model: str) -> None:
        self.servers, self.router, self.model = servers, router, model
        self.decode = servers.decodes[0]

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return http_json(f"{self.router.url}{path}", {"model": self.model, **body})

    def generate_ok(self) -> float:
        return scrape_metric(self.decode.url, "decode_worker_grpc_requests_total",
                             'code="OK",method="Generate"')


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = write_o200k_model(tmp_path_factory.mktemp("o200k") / "tiny-gpt-oss-o200k")
    common = ["--model", str(model), "--set", "cache.page_size=16",
              "--set", "cache.num_full_pages=256", "--set", "cache.num_swa_pages=64"]
    with PdServers(common, grpc=True) as servers:
        port = free_port()
        argv = router_argv(SMG, [(f"grpc://{servers.prefill.grpc_target}", servers.boot_port)],
                           [f"grpc://{servers.decodes[0].grpc_target}"], port)
        with Router(argv, port) as router:
            router.wait_workers(2, 90)
            yield Stack(servers, router, str(model))
            router.stop()


def test_chat_runs_on_smgs_harmony_pipeline(stack: Stack) -> None:
    before = stack.generate_ok()
    out = stack.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                              "temperature": 0})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    # the harmony system message, the user turn and `<|start|>assistant`: tens of tokens
    assert out["usage"]["completion_tokens"] == 8 and out["usage"]["prompt_tokens"] > 40
    assert stack.generate_ok() == before + 1
    assert pool_is_whole(idle_metrics(stack.decode.url)) == []


def test_streamed_chat_ends_with_its_finish_reason(stack: Stack) -> None:
    events = _sse(f"{stack.router.url}/v1/chat/completions",
                  {"model": stack.model, "messages": MESSAGES, "max_tokens": 6,
                   "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"


def test_responses_later_turn_reuses_the_decode_workers_kv(stack: Stack) -> None:
    first = stack.post("/v1/responses", {"input": "Tell me about paged KV caches.",
                                         "max_output_tokens": 8, "temperature": 0})
    assert first["status"] == "completed" and first["usage"]["output_tokens"] == 8
    second = stack.post("/v1/responses", {"input": "And the radix tree?",
                                          "previous_response_id": first["id"],
                                          "max_output_tokens": 8, "temperature": 0})
    assert second["status"] == "completed" and second["usage"]["output_tokens"] == 8
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    # the history smg stored is the prompt's start: whole pages of it stayed cached
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 16
    assert pool_is_whole(idle_metrics(stack.decode.url)) == []


def _sse(url: str, body: dict[str, Any]) -> list[str]:
    """The `data:` payloads of a stream, `[DONE]` included."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return [line[5:].strip() for raw in resp
                if (line := raw.decode().strip()).startswith("data:")]
