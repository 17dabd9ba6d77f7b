"""Every family through the whole product, as real processes: a decode worker (decode radix
cache, host tier, KV events) fed by two reference prefill peers, one per protocol (native and
`--protocol sglang`), on tiny checkpoints transformers wrote (tests/families.py).

Per family and protocol, a three-turn chat plus the last prompt again: greedy tokens equal
transformers' (float32), logprobs within 1e-4, the first turn cold, later turns partial hits
that move fewer bytes, the repeat a full hit. Gemma 3 over SGLang's protocol comes as a stock
SGLang prefill sends it, every layer's KV (the worker lands it and keeps the window): each turn
moves exactly that many bytes. Then, per family, three chats interleaved on a
device pool that holds about one and a half: turns restore their prefix from the host tier, and
an index built only from the worker's KV events predicts every turn's `cached_tokens`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.daemon.shared.procs import PdServers, ServerProcess, http_json, scrape_metric
from decode_worker.io.kv.sglang.prefill_plan import AUX_ROW_BYTES
from tests.e2e.driver import TOP_LOGPROBS, conversation
from tests.e2e.test_e2e_kv_events import replay
from tests.e2e.test_e2e_pd import check_turns
from tests.families import FAMILIES, reference_model
from tests.oracle.helpers import reference_greedy

pytestmark = pytest.mark.slow
PAGE = 16
POOL_PAGES = 28  # the decode worker's full pool (448 tokens): three interleaved chats outgrow it
EVENTS = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": True,
          "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}


@dataclass
class Stack:
    family: str
    decode: ServerProcess
    prefills: dict[str, ServerProcess]
    reference: Callable[[list[int], int], tuple[list[int], list[torch.Tensor]]]

    def generate(self, protocol: str, ids: list[int], max_new: int) -> dict[str, Any]:
        pre = self.prefills[protocol]
        body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": TOP_LOGPROBS,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                    "ignore_eos": True},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": pre.ports["bootstrap"],
                "bootstrap_room": random.getrandbits(63)}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(http_json, f"{pre.url}/generate", body)
            out = http_json(f"{self.decode.url}/generate", body)
            first.result()
        return dict(out)

    def moved(self) -> float:
        return scrape_metric(self.decode.url, "decode_worker_transfer_bytes_total")


def _reference(path: Path) -> Callable[[list[int], int], tuple[list[int], list[torch.Tensor]]]:
    """Greedy tokens and each step's log-softmax from transformers' own forward and cache
    (no logits processors: `generate` would ban the EOS ids the server's ignore_eos keeps)."""
    model = reference_model(path)

    def run(ids: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
        tokens, logits = reference_greedy(model, ids, max_new)
        return tokens, [torch.log_softmax(row, -1) for row in logits]

    return run


@pytest.fixture(scope="module", params=FAMILIES)
def stack(request: pytest.FixtureRequest, family_dir: Callable[[str], Path]) -> Iterator[Stack]:
    family = request.param
    path = family_dir(family)
    common = ["--model", str(path), "--set", f"cache.page_size={PAGE}"]
    decode_args = ["--set", f"cache.num_full_pages={POOL_PAGES}",
                   "--kv-events-config", json.dumps(EVENTS)]
    sglang = ServerProcess("prefill-sglang", ["prefill", "--port", "0", "--bootstrap-port",
                                              "0", "--protocol", "sglang", *common])
    with PdServers(common, prefill_args=["--protocol", "native"],
                   decode_args=decode_args) as pd, sglang:
        sglang.wait_ready(120.0)
        yield Stack(family, pd.decodes[0], {"native": pd.prefill, "sglang": sglang},
                    _reference(path))


@pytest.mark.parametrize("protocol", ["native", "sglang"])
def test_chat_matches_reference_with_cold_partial_and_full_hits(stack: Stack,
                                                                protocol: str) -> None:
    users = conversation(3, seed={"native": 20, "sglang": 21}[protocol])
    history: list[int] = []
    turns, before = [], stack.moved()
    for user in users:
        prompt = history + user
        out = stack.generate(protocol, prompt, 8)
        turns.append({"input_ids": prompt, "output_ids": out["output_ids"],
                      "meta_info": out["meta_info"], "bytes_after": stack.moved()})
        history = prompt + out["output_ids"]
    check_turns(turns, stack.reference, 8, before)
    if stack.family == "gemma3" and protocol == "sglang":  # every layer: 4 x 256 B per token
        sent = [b - a for a, b in zip([before] + [t["bytes_after"] for t in turns[:-1]],
                                      [t["bytes_after"] for t in turns], strict=True)]
        assert sent == [(-(-len(t["input_ids"]) // PAGE) * PAGE
                         - t["meta_info"]["cached_tokens"]) * 1024 + AUX_ROW_BYTES
                        for t in turns], sent
    again = stack.generate(protocol, turns[-1]["input_ids"], 8)  # the whole prompt is cached
    assert again["output_ids"] == turns[-1]["output_ids"]
    cached = again["meta_info"]["cached_tokens"]
    assert cached >= len(turns[-1]["input_ids"]) - PAGE, (cached, len(turns[-1]["input_ids"]))


def test_host_tier_and_kv_events_across_interleaved_chats(stack: Stack) -> None:
    """Three chats take turns on a pool of about one and a half: the tree demotes the others'
    prefixes to the host tier and restores them; the KV-event index predicts every
    `cached_tokens`."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{stack.decode.ports['kv_events_replay']}")
    index, next_seq = KVEventIndex(), 0
    chats = [conversation(3, seed=30 + c) for c in range(3)]
    history: list[list[int]] = [[], [], []]
    try:
        for turn in range(3):
            for c in range(3):
                for seq, events in replay(dealer, next_seq):
                    index.apply(events)
                    next_seq = seq + 1
                prompt = history[c] + chats[c][turn]
                predicted = index.match_len_across(prompt)
                out = stack.generate("native", prompt, 6)
                assert out["meta_info"]["cached_tokens"] == predicted, (turn, c)
                want, _ = stack.reference(prompt, 6)
                assert out["output_ids"] == want, (turn, c)
                history[c] = prompt + out["output_ids"]
    finally:
        dealer.close()
    url = stack.decode.url
    assert scrape_metric(url, "decode_worker_prefix_cache_host_hit_tokens_total") > 0
    assert scrape_metric(url, "decode_worker_kv_evicted_pages_total", 'pool="full"') > 0
    assert index.orphan_stores == index.unknown_removals == 0


WEATHER = {"type": "function", "function": {  # short: every byte is a prompt token here
    "name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}}


def test_chat_renders_the_checkpoint_template_and_returns_forced_tool_calls(
        stack: Stack, family_dir: Callable[[str], Path]) -> None:
    """/v1/chat/completions renders the checkpoint's own chat template as transformers does
    (the same prompt tokens); with tools (Qwen3: `<tool_call>` JSON, Llama 3: JSON) a forced
    call comes back as `message.tool_calls`, parsed as SGLang's parsers parse it."""
    import transformers

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"}]
    calls = stack.family != "gemma3"
    tools = [WEATHER] if calls else None
    hf = transformers.AutoTokenizer.from_pretrained(family_dir(stack.family))
    want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    pre = stack.prefills["native"]
    body: dict[str, Any] = {"messages": messages, "max_tokens": 80, "temperature": 0,
                            "bootstrap_host": "127.0.0.1",
                            "bootstrap_port": pre.ports["bootstrap"],
                            "bootstrap_room": random.getrandbits(63)}
    if calls:
        body.update(tools=tools, tool_choice="required")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(http_json, f"{pre.url}/v1/chat/completions", body)
        out = http_json(f"{stack.decode.url}/v1/chat/completions", body)
        first.result()
    assert out["usage"]["prompt_tokens"] == len(want)
    choice = out["choices"][0]
    if not calls:
        assert choice["message"]["content"] is not None
        return
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}

