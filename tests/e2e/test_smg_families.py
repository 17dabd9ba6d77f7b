"""smg (the SGLang Model Gateway) in front of a Qwen3 model: over HTTP (PD mode, the router of
record) and over gRPC (`grpc://` workers: smg tokenizes, renders Qwen3's chat template and parses
its output itself), on a tiny checkpoint transformers wrote (tests/families.py).

Checked: HTTP: a three-turn conversation through smg equals transformers' greedy tokens and
logprobs, later turns cached, and smg's /flush_cache reaches both workers. gRPC: `/generate`
equals the HTTP path token for token, a later turn reuses the earlier one's KV, and a chat turn
through smg's own Qwen3 rendering prompts the worker with as many tokens as transformers'
rendering of the checkpoint's template.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.procs import PdServers, free_port, http_json
from decode_worker.daemon.shared.router import SMG, Router, has_router, router_argv
from tests.e2e.test_e2e_families import _reference
from tests.e2e.test_e2e_pd import ROOT, _router_skip_reason, check_turns

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed")]
PROMPT = [random.Random(6).randrange(3, 250) for _ in range(70)]


def test_multi_turn_through_smg_over_http_matches_reference(
        family_dir: Callable[[str], Path], tmp_path: Path) -> None:
    reason = _router_skip_reason()
    if reason:
        pytest.skip(reason)
    model, out = family_dir("qwen3"), tmp_path / "result.json"
    script = (f"ip link set lo up && exec {sys.executable} -m tests.e2e.driver --router "
              f"--model {model} --out {out} --turns 3 --protocol native")
    proc = subprocess.run(["unshare", "-n", "bash", "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    check_turns(result["turns"], _reference(model), 8)
    assert result["router_flush"]["workers_flushed"] == 2, result["router_flush"]


class GrpcStack:
    def __init__(self, servers: PdServers, router: Router, model: str) -> None:
        self.servers, self.router, self.model = servers, router, model

    def http_pd(self, path: str, body: dict[str, Any]) -> Any:
        body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.servers.boot_port,
                "bootstrap_room": random.getrandbits(62)}
        with ThreadPoolExecutor(1) as pool:
            pre = pool.submit(http_json, f"{self.servers.prefill.url}{path}", body)
            out = http_json(f"{self.servers.decodes[0].url}{path}", body)
            pre.result(60)
        return out

    def smg(self, path: str, body: dict[str, Any]) -> Any:
        answer = http_json(f"{self.router.url}{path}", {"model": self.model, **body})
        return answer[0] if isinstance(answer, list) else answer


@pytest.fixture(scope="module")
def grpc_stack(family_dir: Callable[[str], Path]) -> Iterator[GrpcStack]:
    model = family_dir("qwen3")
    common = ["--model", str(model), "--set", "cache.page_size=16",
              "--set", "cache.num_full_pages=512"]
    with PdServers(common, grpc=True) as servers:
        port = free_port()
        argv = router_argv(SMG, [(f"grpc://{servers.prefill.grpc_target}", servers.boot_port)],
                           [f"grpc://{servers.decodes[0].grpc_target}"], port)
        router = Router(argv, port)
        with router:
            router.wait_workers(2, 90)
            yield GrpcStack(servers, router, str(model))
        router.stop()


def _gen(ids: list[int], max_new: int) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


def test_grpc_generate_is_token_exact_and_reuses_kv(grpc_stack: GrpcStack) -> None:
    http = grpc_stack.http_pd("/generate", _gen(PROMPT, 8))
    first = grpc_stack.smg("/generate", _gen(PROMPT, 8))
    assert first["output_ids"] == http["output_ids"] and len(first["output_ids"]) == 8
    history = PROMPT + first["output_ids"] + [9] * 20
    second = grpc_stack.smg("/generate", _gen(history, 6))
    assert second["meta_info"]["cached_tokens"] >= 64
    assert second["output_ids"] == grpc_stack.http_pd("/generate", _gen(history, 6))["output_ids"]


def test_grpc_chat_renders_qwen3s_template_as_transformers_does(
        grpc_stack: GrpcStack, family_dir: Callable[[str], Path]) -> None:
    import transformers

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
    hf = transformers.AutoTokenizer.from_pretrained(family_dir("qwen3"))
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    out = grpc_stack.smg("/v1/chat/completions", {"messages": messages, "max_tokens": 6,
                                                  "temperature": 0})
    assert out["usage"]["prompt_tokens"] == len(want)
    assert out["usage"]["completion_tokens"] >= 1
