"""The scale-out workload: C multi-turn chat conversations through a router, and what it reuses.

Every conversation opens with the same system prompt (an assistant's instructions) and then has
T user turns of a few sentences each (seeded, so every run sends the same user text); turn t's
request carries the whole history (system, earlier user turns and the answers received) to
`POST /v1/chat/completions`, streamed, greedy, `max_tokens` fixed. The conversations run at
once, each turn after the previous answer. Per turn we keep `usage.prompt_tokens`,
`usage.prompt_tokens_details.cached_tokens`, the completion tokens, the time to the first
content chunk and the time per output token after it.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

SYSTEM = ("You are the support assistant of a company that runs language models on many "
          "machines. Answer in one or two plain sentences, stay polite, never invent numbers, "
          "and say so when you do not know. Prefill and decode run on different machines; the "
          "decode side keeps a cache of earlier turns, so a long conversation is cheap to "
          "continue where it was left. Keep answers short and to the point.")
WORDS = (
    "cache", "page", "window", "token", "prefill", "decode", "router", "worker", "gateway",
    "request", "turn", "answer", "memory", "transfer", "batch", "model", "queue", "policy",
    "session", "prompt", "reuse", "replica", "latency", "cluster", "tree", "node", "evict",
    "sticky", "hash", "prefix", "load",
)


@dataclass
class Turn:
    """One answered turn of one conversation."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float | None  # None with a single output token


def user_turns(conversations: int, turns: int, seed: int = 0) -> list[list[str]]:
    """Per conversation, the text of its `turns` user messages (deterministic in `seed`)."""
    rng = random.Random(seed)
    return [[" ".join(rng.choice(WORDS) for _ in range(rng.randrange(12, 30))) + "?"
             for _ in range(turns)] for _ in range(conversations)]


def chat_stream(url: str, body: dict[str, Any], headers: dict[str, str],
                timeout_s: float = 300.0, path: str = "/v1/chat/completions",
                ) -> tuple[str, dict[str, Any], float, float]:
    """POST a streaming chat completion; (content, usage, ttft_s, tpot_s or -1). The first
    token is the first chunk (the role chunk leaves with it; the text may come later in one
    piece, as gpt-oss's harmony parsing holds it back), the last one the chunk with the
    `finish_reason`. Raises RuntimeError when the stream ends without a usage chunk or carries
    an error event. `path` "/v1/completions": the same for a text completion."""
    data = json.dumps({**body, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    t0 = time.perf_counter()
    first = last = 0.0
    content, usage = "", None
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                now = time.perf_counter()
                first = first or now
                content += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if choice.get("finish_reason"):
                    last = now
    if usage is None or not first:
        raise RuntimeError("the stream ended without a first chunk or a usage chunk")
    n_out = int(usage.get("completion_tokens", 0))
    tpot = (last - first) / (n_out - 1) if n_out > 1 and last else -1.0
    return content, usage, first - t0, tpot


def play(url: str, model: str, users: list[list[str]], max_tokens: int,
         routing_key: Callable[[int], str | None] = lambda _: None,
         completions: bool = False) -> list[Turn]:
    """Every conversation through the router at `url`, all at once, turn after turn. With
    `routing_key(i)` not None, conversation i's requests carry `X-SMG-Routing-Key`. With
    `completions`, each turn is a `/v1/completions` prompt (the history as plain text: smg's
    gRPC mode renders gpt-oss chat with its harmony vocabulary, which the tiny model lacks)."""

    def one(i: int) -> list[Turn]:
        messages = [{"role": "system", "content": SYSTEM}]
        key = routing_key(i)
        headers = {"X-SMG-Routing-Key": key} if key else {}
        out = []
        for t, text in enumerate(users[i]):
            messages.append({"role": "user", "content": text})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            if completions:
                body["prompt"] = "".join(f"{m['role']}: {m['content']}\n"
                                         for m in body.pop("messages"))
            answer, usage, ttft, tpot = chat_stream(
                url, body, headers, path="/v1/completions" if completions else
                "/v1/chat/completions")
            messages.append({"role": "assistant", "content": answer})
            details = usage.get("prompt_tokens_details") or {}
            out.append(Turn(i, t, int(usage["prompt_tokens"]),
                            int(details.get("cached_tokens") or 0),
                            int(usage["completion_tokens"]), ttft, tpot if tpot >= 0 else None))
        return out

    with ThreadPoolExecutor(max_workers=len(users)) as pool:
        return [turn for turns in pool.map(one, range(len(users))) for turn in turns]


def hit_rate(turns: list[Turn]) -> float:
    """Cached / prompt tokens over `turns` (0 if there are none)."""
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0


def later_turn_hit(turns: list[Turn]) -> float:
    """The hit rate of the turns after each conversation's first (turns 2..T)."""
    return hit_rate([t for t in turns if t.turn > 0])


def p50_ms(values: list[float | None]) -> float:
    """The median of the values that are set, in milliseconds (nan when none are)."""
    known = [v for v in values if v is not None]
    return 1000.0 * statistics.median(known) if known else float("nan")
