"""End-to-end driver: prefill peer + decode worker(s) (+ a router in PD mode), a multi-turn chat.

Run as a script (the router tests run it inside a loopback-only network namespace):
    python -m tests.e2e.driver --model DIR --out result.json [--router [--router-kind K]]
        [--chats N] [--seed S] [--full-hit] [--decode-set SECTION.KEY=VALUE ...]
It writes, per turn, the chat it belongs to, the prompt ids sent, the output ids and meta_info
received, the decode worker's transfer bytes after the turn, and the final /metrics scrapes
(`metrics_idle` once the last turn wound down, `metrics` at the end); with the router, also its
answer to a /flush_cache after the last turn. `--chats N` interleaves N conversations turn by
turn (with a small device pool, each chat's earlier turns are evicted before its next one);
chat c uses seed S + c. `--full-hit`: each chat's last message is cut so that its prompt is a
whole number of pages, and that prompt is sent twice (a retry: the decode worker holds it in
full the second time).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from decode_worker.daemon.shared.procs import (
    PdServers,
    free_port,
    http_json,
    scrape_metric,
)
from decode_worker.daemon.shared.router import SGLANG_ROUTER, SMG, Router, router_argv
from tests.e2e.live_fixtures import Metrics, pool_is_whole

PAGE_SIZE = 16
TOP_LOGPROBS = 5  # alternatives asked per token: the first token's come through the aux row



def conversation(turns: int, seed: int = 0) -> list[list[int]]:
    """User turns as token ids (byte-level ids of the tiny model's vocabulary)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(150)]  # longer than window + page
    return [system] + [[rng.randrange(3, 250) for _ in range(rng.randrange(20, 60))]
                       for _ in range(turns - 1)]


class Workers(PdServers):
    """Prefill peer and decode worker(s) as child processes (and the router if asked).

    `num_decode` decode workers (`decodes`; `decode` is the first) behind `router_kind` (smg,
    the router of record, or sglang-router for the compatibility test) with `policy` for both
    sides and `decode_policy` for the decode side if given. `decode_extra` adds arguments to the
    decode workers only."""

    def __init__(self, model: Path, router: bool, extra: list[str],
                 protocol: str = "native", *, num_decode: int = 1, router_kind: str = SMG,
                 policy: str = "round_robin", decode_policy: str | None = None,
                 decode_extra: list[str] | None = None) -> None:
        super().__init__(["--model", str(model), "--set", f"cache.page_size={PAGE_SIZE}",
                          *extra], num_decode, prefill_args=["--protocol", protocol],
                         decode_args=decode_extra or [])
        self.decode = self.decodes[0]
        self.router: Router | None = None
        self._router_args = (router_kind, policy, decode_policy) if router else None

    @property
    def decode_port(self) -> int:
        return self.decode.port

    def __enter__(self) -> Workers:
        super().__enter__()
        if self._router_args is not None:  # the workers' ports are known now
            try:
                kind, policy, decode_policy = self._router_args
                port = free_port()  # a taken one makes wait_workers retry on another
                self.router = Router(router_argv(
                    kind, [(self.prefill.url, self.boot_port)], [d.url for d in self.decodes],
                    port, policy=policy, decode_policy=decode_policy), port)
                self.router.__enter__()
                self.router.wait_workers(1 + len(self.decodes), 60)
            except BaseException:
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.router is not None:
            self.router.stop()
        super().__exit__(*exc)

    def generate(self, pool: ThreadPoolExecutor, input_ids: list[int],
                 max_new: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": input_ids, "return_logprob": True, "top_logprobs_num": TOP_LOGPROBS,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
        if self.router is not None:
            return dict(http_json(f"{self.router.url}/generate", body))
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=self.boot_port,
                    bootstrap_room=random.getrandbits(63))
        pre = pool.submit(http_json, f"{self.prefill.url}/generate", body)
        out = http_json(f"{self.decode.url}/generate", body)
        pre.result()
        return dict(out)


class RouterProcess(Router):
    """One prefill peer and one decode worker behind a router in PD mode on loopback
    (`router_kind`: smg by default, or sglang-router), round robin."""

    def __init__(self, prefill_url: str, boot_port: int, decode_url: str, port: int,
                 router_kind: str = SMG) -> None:
        super().__init__(router_argv(router_kind, [(prefill_url, boot_port)], [decode_url],
                                     port), port)

    def wait_workers(self, timeout_s: float, count: int = 2) -> None:  # type: ignore[override]
        super().wait_workers(count, timeout_s)


def play(workers: Workers, turns: int, max_new: int, chats: int = 1, *, seed: int = 0,
         full_hit: bool = False) -> list[dict[str, Any]]:
    """`chats` conversations (chat c uses seed `seed + c`), one turn of each in turn. With
    `full_hit`, each chat's last prompt is cut to whole pages and sent twice."""
    users = [conversation(turns, seed=seed + c) for c in range(chats)]
    history: list[list[int]] = [[] for _ in range(chats)]
    results = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for turn in range(turns):
            for c in range(chats):
                retry = full_hit and turn == turns - 1
                prompt = history[c] + users[c][turn]
                if retry:  # messages are >= 20 tokens: at most 15 go
                    prompt = prompt[: len(prompt) - len(prompt) % PAGE_SIZE]
                for _ in range(2 if retry else 1):
                    out = workers.generate(pool, prompt, max_new)
                    moved = scrape_metric(workers.decode.url, "decode_worker_transfer_bytes_total")
                    results.append({"chat": c, "input_ids": prompt, "output_ids": out["output_ids"],
                                    "meta_info": out["meta_info"], "bytes_after": moved})
                history[c] = prompt + out["output_ids"]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--router", action="store_true")
    ap.add_argument("--router-kind", default=SMG, choices=[SMG, SGLANG_ROUTER])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--decode-set", action="append", default=[],
                    help="a setting for the decode worker only (e.g. a small device pool)")
    ap.add_argument("--chats", type=int, default=1, help="conversations, interleaved")
    ap.add_argument("--seed", type=int, default=0, help="chat c plays conversation seed + c")
    ap.add_argument("--full-hit", action="store_true",
                    help="the last prompt of each chat, cut to whole pages, is sent twice")
    ap.add_argument("--protocol", default="native", choices=["native", "sglang"],
                    help="the protocol the prefill peer serves (the decode worker finds out)")
    args = ap.parse_args(argv)
    extra = [x for s in args.set for x in ("--set", s)]
    decode_extra = [x for s in args.decode_set for x in ("--set", s)]
    with Workers(args.model, args.router, extra, args.protocol, router_kind=args.router_kind,
                 decode_extra=decode_extra) as w:
        results = play(w, args.turns, args.max_new, args.chats, seed=args.seed,
                       full_hit=args.full_hit)
        out: dict[str, Any] = {"turns": results}
        wait_idle(w.decode.url)  # a flush is refused while the last turn still winds down
        out["metrics_idle"] = wait_whole(w.decode.url)
        if w.router is not None:  # the router sends its /flush_cache on to every worker
            out["router_flush"] = http_json(f"{w.router.url}/flush_cache", {})
        out["metrics"] = get_text(f"{w.decode.url}/metrics")
        args.out.write_text(json.dumps(out))
    return 0


def wait_idle(url: str, timeout_s: float = 30.0) -> None:
    """Until the worker's /get_load shows nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = http_json(f"{url}/get_load")[0]
        if not load["num_reqs"] and not load["num_waiting_reqs"]:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{url} not idle after {timeout_s}s")


def wait_whole(url: str, timeout_s: float = 15.0) -> str:
    """The worker's /metrics once every device page is free or cached and none is held (the
    gauges follow the engine with a short lag); the last scrape at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = get_text(f"{url}/metrics")
        if not pool_is_whole(Metrics(text)) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


if __name__ == "__main__":
    raise SystemExit(main())
