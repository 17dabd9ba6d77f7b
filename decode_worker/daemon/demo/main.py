"""`decode-worker demo`: a prefill peer and a decode worker on loopback, a multi-turn chat.

Starts both servers as child processes with the built-in model (or `--model`), then plays the
router's part: every request goes to the prefill peer and the decode worker at once, with the
same `bootstrap_room`, and the answer is the decode worker's. Prints a report: requests,
tokens/s, the decode-side prefix hit rate per turn, and KV bytes moved against what the same
traffic would move without the decode radix cache.

The decode worker's device pool is kept small on purpose (`--device-pages`, by default about
half of what the conversations hold by their last turn, and room for the largest request), so the
conversations outgrow it: the host tier (on by default) keeps what the device pool evicts, and
the report says how much of the reuse came from it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decode_worker.core.memory_budget import colocated_share
from decode_worker.daemon.shared.procs import ServerProcess, http_json, scrape_metric
from decode_worker.errors import ConfigError
from decode_worker.settings import LoadedSettings

SYSTEM = ("You are a helpful assistant for a decode worker demo. Answer briefly and stay on "
          "topic. The conversation below is between a user and you. You know how prefill and "
          "decode are split across machines, how a KV cache is paged, how sliding-window "
          "layers keep only their window, and why a radix tree lets later turns reuse what "
          "earlier ones computed. Keep every answer to a sentence or two.")
QUESTIONS = ["What is a KV cache?", "Why split prefill and decode?", "What does NIXL move?",
             "How does a sliding window help?", "What is a radix tree for?", "Say it shorter.",
             "Give an example.", "And the SWA tail?"]


@dataclass
class TurnStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Conversation:
    idx: int
    messages: list[dict[str, str]] = field(default_factory=list)


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    s = loaded.settings
    host = "127.0.0.1"
    # ports: --port / --bootstrap-port if given, else any free ones, which each child binds
    # and reports (no race with other processes between a pick and a bind)
    decode_port = s.server.port if getattr(args, "port", None) is not None else 0
    boot_port = args.bootstrap_port or 0
    # three programs on one device: each its own share of the card (CUDA; ignored on CPU)
    share = colocated_share(3, s.cache.memory_fraction)
    common = ["--set", f"cache.page_size={s.cache.page_size}",
              "--set", f"cache.memory_fraction={share}"]
    model = demo_model(args, loaded)
    if model is not None:
        common += ["--model", str(model)]
    pages = demo_device_pages(args, s.cache.page_size)
    small = ["--set", f"cache.num_full_pages={pages}"] if pages else []
    print(f"demo: starting a prefill peer, a decode worker and, for comparison, one without "
          f"the decode radix cache on {host}", flush=True)
    with ServerProcess("prefill", ["prefill", "--port", "0", "--bootstrap-port",
                                   str(boot_port), *common]) as pre, \
         ServerProcess("decode", ["serve", "--port", str(decode_port), *common,
                                  *small]) as dec, \
         ServerProcess("decode-nocache", ["serve", "--port", "0", *common,
                                          "--set", "cache.decode_radix_cache=false"]) as plain:
        for server in (pre, dec, plain):
            server.wait_ready(120.0)
        boot_port = pre.ports["bootstrap"]
        print(f"demo: prefill peer :{pre.port} (bootstrap :{boot_port}), decode worker "
              f":{dec.port}, without the cache :{plain.port}", flush=True)
        report = _play(args, pre.url, dec.url, host, boot_port, "with the cache")
        # the same conversations again (greedy, so the same prompts) without the cache
        _play(args, pre.url, plain.url, host, boot_port, "without it")
        moved = scrape_metric(dec.url, "decode_worker_transfer_bytes_total")
        without = scrape_metric(plain.url, "decode_worker_transfer_bytes_total")
        report["host"] = _host_tier(dec.url, s.cache.page_size)
        _print_report(report, moved, without)
    return 0


def demo_model(args: argparse.Namespace, loaded: LoadedSettings) -> Path | None:
    """The model directory both servers load: `--family` (a tiny seeded random model of it,
    written once under model.cache_dir), else `--model` / model.path, else None (the servers'
    default, the tiny gpt-oss). Raises ConfigError for both flags or an unknown family."""
    s = loaded.settings
    family = getattr(args, "family", None)
    if family is None:
        return None if s.model.path is None else Path(s.model.path)
    if s.model.path is not None:
        raise ConfigError("demo: give --family or --model, not both")
    from decode_worker.device.model.tiny import ensure_tiny_model  # imports torch

    path = ensure_tiny_model(s.model.cache_dir, family, s.model.seed)
    print(f"demo: tiny {family} model (seed {s.model.seed}) at {path}", flush=True)
    return path


def demo_device_pages(args: argparse.Namespace, page_size: int) -> int:
    """The decode worker's full pool for the demo (0: the worker sizes it itself): room for the
    largest request (its last turn) with a margin, and about half of what every conversation
    holds by then, so that they outgrow it. Token counts are bounded by UTF-8 bytes (plus the
    chat template's), so the pool is never too small for a request whatever the tokenizer."""
    if args.device_pages is not None:
        return int(args.device_pages)
    system = len(SYSTEM.encode()) + 64
    turn = max(len(q.encode()) for q in QUESTIONS) + 2 * args.max_new_tokens + 32
    largest = system + args.turns * turn
    everything = system + args.conversations * args.turns * turn
    return math.ceil(max(1.25 * largest, everything / 2) / page_size)


def _host_tier(url: str, page_size: int) -> dict[str, float]:
    """What the decode worker's host tier did, from its /metrics."""
    def m(name: str, labels: str = "") -> float:
        return scrape_metric(url, f"decode_worker_{name}", labels)

    return {"device_pages": m("kv_pages_capacity", 'pool="full"'),
            "host_pages": m("kv_pages_capacity", 'pool="host"'),
            "host_pages_used": m("kv_pages_used", 'pool="host"'),
            "demoted_pages": m("kv_evicted_pages_total", 'pool="full"'),
            "host_hit_tokens": m("prefix_cache_host_hit_tokens_total"),
            "restored_bytes": m("kv_host_restored_bytes_total"),
            "page_size": page_size}


def _play(args: argparse.Namespace, prefill: str, decode: str, boot_host: str,
          boot_port: int, label: str) -> dict[str, Any]:
    convs = [Conversation(i, [{"role": "system", "content": SYSTEM}])
             for i in range(args.conversations)]
    turns = [TurnStats() for _ in range(args.turns)]
    total = args.turns * args.conversations
    rng = random.Random(0)
    t0 = time.monotonic()
    done = 0
    with ThreadPoolExecutor(max_workers=2 * args.conversations) as pool:
        for turn in range(args.turns):
            for conv in convs:
                conv.messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
            # the first conversation opens alone, so the others can reuse the shared system
            # prompt from the decode side's tree (all at once, none would find it yet)
            first = [_chat(pool, prefill, decode, convs[0], args.max_new_tokens, boot_host,
                           boot_port)] if turn == 0 else []
            jobs = [pool.submit(_chat, pool, prefill, decode, conv, args.max_new_tokens,
                                boot_host, boot_port) for conv in convs[len(first):]]
            for usage in itertools.chain(first, (job.result() for job in jobs)):
                _add(turns[turn], usage)
                done += 1
                _progress(label, done, total, time.monotonic() - t0)
    print(file=sys.stderr)
    return {"turns": turns, "elapsed_s": time.monotonic() - t0}


def _chat(pool: ThreadPoolExecutor, prefill: str, decode: str, conv: Conversation,
          max_new: int, boot_host: str, boot_port: int) -> dict[str, Any]:
    body = {"messages": conv.messages, "max_tokens": max_new,
            "temperature": 0, "bootstrap_host": boot_host, "bootstrap_port": boot_port,
            "bootstrap_room": random.getrandbits(63)}
    pre = pool.submit(http_json, f"{prefill}/v1/chat/completions", body)
    answer = http_json(f"{decode}/v1/chat/completions", body)
    pre.result()
    conv.messages.append({"role": "assistant",
                          "content": answer["choices"][0]["message"]["content"]})
    return dict(answer["usage"])


def _add(t: TurnStats, usage: dict[str, Any]) -> None:
    t.requests += 1
    t.prompt_tokens += usage["prompt_tokens"]
    t.completion_tokens += usage["completion_tokens"]
    t.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _progress(label: str, done: int, total: int, elapsed_s: float) -> None:
    width = 30
    filled = width * done // total
    bar = "#" * filled + "-" * (width - filled)
    print(f"\r{label:>15} [{bar}] {done}/{total} requests  {elapsed_s:5.1f}s", end="",
          file=sys.stderr, flush=True)


def _print_report(report: dict[str, Any], moved_bytes: float, without: float) -> None:
    turns: list[TurnStats] = report["turns"]
    elapsed = report["elapsed_s"]
    reqs = sum(t.requests for t in turns)
    out_tok = sum(t.completion_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    prompt = sum(t.prompt_tokens for t in turns)
    print("\n== decode-worker demo ==")
    print(f"requests: {reqs} in {elapsed:.1f}s  ({reqs / elapsed:.2f} req/s)")
    print(f"tokens:   {out_tok} generated, {out_tok / elapsed:.1f} tok/s end to end")
    print(f"prefix reuse: {cached} of {prompt} prompt tokens held by the decode worker "
          f"({cached / max(prompt, 1):.1%})")
    host = report["host"]
    _print_host(host, cached)
    print("turn  prompt_tokens  cached_tokens  decode-side hit rate")
    for i, t in enumerate(turns, 1):
        rate = t.cached_tokens / t.prompt_tokens if t.prompt_tokens else 0.0
        print(f"{i:>4}  {t.prompt_tokens:>13}  {t.cached_tokens:>13}  {rate:>19.1%}")
    saved = 1 - moved_bytes / without if without else 0.0
    print(f"KV moved: {moved_bytes / 1e6:.2f} MB with the decode radix cache, "
          f"{without / 1e6:.2f} MB without it ({saved:.1%} saved)")
    print(json.dumps({"requests": reqs, "tokens_per_s": round(out_tok / elapsed, 2),
                      "kv_bytes_moved": moved_bytes, "kv_bytes_without_cache": without,
                      "device_hit_tokens": cached - int(host["host_hit_tokens"]),
                      "host_hit_tokens": int(host["host_hit_tokens"]),
                      "host_restored_bytes": host["restored_bytes"]}))


def _print_host(host: dict[str, float], cached: int) -> None:
    """Where the reuse came from: the device pool, or the host tier (what the device pool
    evicted and the host tier kept)."""
    ps = int(host["page_size"])
    dev, hp = int(host["device_pages"]), int(host["host_pages"])
    hits = int(host["host_hit_tokens"])
    print(f"  device pool {dev} pages ({dev * ps} tokens): {cached - hits} reused tokens found "
          f"there; {int(host['demoted_pages'])} pages evicted from it")
    if not hp:
        print("  host tier off (cache.hierarchical_cache=false)")
        return
    print(f"  host tier {hp} pages ({hp * ps} tokens), {int(host['host_pages_used'])} in use at "
          f"the end: {hits} reused tokens restored from it "
          f"({host['restored_bytes'] / 1e6:.2f} MB host -> device), which the device pool "
          f"alone had lost")

