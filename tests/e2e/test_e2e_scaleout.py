"""Two decode workers behind the SGLang Model Gateway (smg, cache_aware decode routing) keep the
prefix reuse one decode worker has, and every answer is the reference implementation's.

One prefill peer and two decode workers (real processes, NIXL on loopback). The same
conversations (each opens with its own ticket line, then the assistant's instructions and user
turns; token ids from the model's own tokenizer, the history carried as ids) run twice through
smg's `/generate`: once with only the first decode worker behind it, once with both and
`--decode-policy cache_aware`, every cache flushed in between. The conversations share no long
prefix, so smg spreads their first turns by load and must then keep each on its worker: both
workers serve, the later-turn hit rate (`meta_info.cached_tokens` / `prompt_tokens`, turns 2..T)
with two workers is at least 90 % of the single worker's, and every answer is token-exact
against transformers' greedy run of the same prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.procs import http_json
from decode_worker.daemon.shared.router import has_router
from decode_worker.device.tokenizer import Tokenizer
from scripts.scaleout_lib.stack import Stack
from scripts.scaleout_lib.workload import SYSTEM, user_turns

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed")]
CONVERSATIONS, TURNS, MAX_NEW = 4, 3, 6
Reference = Callable[[list[int], int], tuple[list[int], list[float]]]


def _play(url: str, systems: list[list[int]],
          users: list[list[list[int]]]) -> list[dict[str, Any]]:
    """All conversations at once, turn after turn: per turn, the prompt ids sent and the
    `/generate` answer's output ids, prompt and cached token counts."""

    start = threading.Barrier(len(users))  # the first turns in flight together, even on a
    # loaded host where threads start late: the router sees every conversation's load

    def one(i: int) -> list[dict[str, Any]]:
        start.wait()
        history, out = list(systems[i]), []
        for t, user in enumerate(users[i]):
            prompt = history + user
            body = {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
            answer = http_json(f"{url}/generate", body)
            meta = answer["meta_info"]
            out.append({"turn": t, "input_ids": prompt, "output_ids": answer["output_ids"],
                        "prompt_tokens": meta["prompt_tokens"],
                        "cached_tokens": meta["cached_tokens"]})
            history = prompt + answer["output_ids"]
        return out

    with ThreadPoolExecutor(len(users)) as pool:
        return [turn for turns in pool.map(one, range(len(users))) for turn in turns]


def _hit(turns: list[dict[str, Any]]) -> float:
    later = [t for t in turns if t["turn"] > 0]
    return sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later)


def test_two_decode_workers_behind_smg_keep_the_single_workers_reuse(
        e2e_model_dir: Path, reference_greedy: Reference) -> None:
    tok = Tokenizer.from_dir(e2e_model_dir)
    systems = [tok.encode(f"Ticket {i}. {SYSTEM}") for i in range(CONVERSATIONS)]
    users = [[tok.encode(" " + text) for text in conv]
             for conv in user_turns(CONVERSATIONS, TURNS, seed=3)]
    runs: dict[str, list[dict[str, Any]]] = {}
    shares: list[int] = []
    with Stack(e2e_model_dir, num_decode=2) as stack:
        for label, policy, n in (("single", "round_robin", 1), ("cache_aware", "cache_aware", 2)):
            stack.flush()
            before = stack.served()
            with stack.routed(policy, n) as router:
                runs[label] = _play(router.url, systems, users)
            shares = [b - a for a, b in zip(before, stack.served(), strict=True)]
    assert sum(shares) == CONVERSATIONS * TURNS, shares
    assert min(shares) >= TURNS, f"each worker serves a conversation: {shares}"
    single, scaled = _hit(runs["single"]), _hit(runs["cache_aware"])
    assert single > 0.5, f"the single worker reuses earlier turns: {single:.3f}"
    assert scaled >= 0.9 * single, (f"two workers reuse {scaled:.3f} of later prompts, one "
                                    f"worker {single:.3f}; requests per worker {shares}")
    expected: dict[tuple[int, ...], list[int]] = {}
    for label, turns in runs.items():
        for turn in turns:
            key = tuple(turn["input_ids"])
            if key not in expected:
                expected[key] = reference_greedy(turn["input_ids"], MAX_NEW)[0]
            assert turn["prompt_tokens"] == len(turn["input_ids"])
            assert turn["output_ids"] == expected[key], (label, turn["turn"])
