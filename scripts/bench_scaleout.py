"""Scale-out benchmark: do N decode workers behind the gateway keep the reuse one worker has?

    python scripts/bench_scaleout.py --workers 3 [--pool-pages 128]
    python -m scripts.bench_scaleout --workers 3

Starts one prefill peer and N decode workers on loopback (the built-in tiny model, or
`--model`), then plays the same C conversations x T turns (`scaleout_lib/workload.py`: a shared
system prompt and user turns through `/v1/chat/completions`, streamed, greedy) once through a
router in front of the first decode worker alone ("single") and once per decode policy in front
of all N: round_robin, cache_aware, prefix_hash, and manual with an `X-SMG-Routing-Key` per
conversation (sticky sessions). Every run starts with every decode worker's cache flushed and a
fresh router (the gateway's own routing state starts cold too). `--pool-pages P` gives each
decode worker P pages in each KV pool, so the cache must evict.

Per run it prints the later-turn hit rate (sum of `usage.prompt_tokens_details.cached_tokens`
over sum of `prompt_tokens`, turns 2..T; and the same for turn 1), the requests each decode
worker ended (its `decode_worker_requests_total`), how many of them did not finish (a decode
worker aborted or failed them and the router retried them elsewhere), and the median time to
first token and time per output token (client side, through the router; on a small shared CPU
box these mostly measure contention). `--sticky` sends the routing key with every policy and
adds `--routing-key-override`; `--router-args` passes more flags to the N-worker routers.
`--grpc` adds a cache_aware run with smg in gRPC mode (`grpc://` workers: smg subscribes to
their KV events) and plays every run through `/v1/completions` (smg's gRPC chat renders
gpt-oss prompts in the harmony vocabulary, which the tiny model lacks); a line before the
last compares the two modes' later-turn hit rates.
The last line is exactly

    bench_scaleout: workers=<N> single=<hit> cache_aware=<hit> best=<policy>:<hit>

hits in percent with one decimal (`best`: the N-worker policy with the highest hit rate; `n/a`
for a policy not run). A benchmark, not a test: CI runs the e2e test built on the same parts.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_worker.daemon.shared.procs import scrape_metric
from decode_worker.daemon.shared.router import SGLANG_ROUTER, SMG, has_router
from scripts.scaleout_lib.stack import Stack
from scripts.scaleout_lib.workload import (
    hit_rate,
    later_turn_hit,
    p50_ms,
    play,
    user_turns,
)

POLICIES = ("round_robin", "cache_aware", "prefix_hash", "manual")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_scaleout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3, help="decode workers (N)")
    ap.add_argument("--conversations", type=int, default=9, help="conversations (C)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation (T)")
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per answer")
    ap.add_argument("--pool-pages", type=int, default=None,
                    help="pages in each KV pool of each decode worker (forces eviction)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated decode policies (default: {','.join(POLICIES)})")
    ap.add_argument("--router", default=SMG, choices=[SMG, SGLANG_ROUTER])
    ap.add_argument("--sticky", action="store_true",
                    help="every policy's requests carry X-SMG-Routing-Key (one per "
                    "conversation) and the router gets --routing-key-override")
    ap.add_argument("--router-args", default="",
                    help="more router flags for the N-worker runs (one string, shell-split)")
    ap.add_argument("--model", type=Path, help="HF model dir (default: the built-in tiny one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", type=Path, help="also write the results here")
    ap.add_argument("--grpc", action="store_true",
                    help="also run cache_aware with smg in gRPC mode (grpc:// workers, KV "
                    "events when the workers publish them); every run then plays the "
                    "conversations through /v1/completions, so both modes see one workload")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if bad := [p for p in policies if p not in POLICIES]:
        ap.error(f"unknown policies {bad}; known: {', '.join(POLICIES)}")
    if args.workers < 2 or args.conversations < 1 or args.turns < 2:
        ap.error("need --workers >= 2, --conversations >= 1 and --turns >= 2")
    if not has_router(args.router):
        ap.error(f"{args.router} is not installed (pip install -e '.[test]')")
    model = args.model or _tiny_model()
    if args.grpc and args.router != SMG:
        ap.error("--grpc needs --router smg")
    with Stack(model, args.workers, args.pool_pages, args.router, grpc=args.grpc) as stack:
        results = run_all(stack, args, policies)
        if args.grpc:
            calls = {label: sum(int(scrape_metric(d.url, "decode_worker_grpc_requests_total",
                                                  f'{code}method="SubscribeKvEvents"'))
                                for d in stack.decodes)
                     for label, code in (("all", ""), ("UNIMPLEMENTED", 'code="UNIMPLEMENTED",'))}
    _print_table(results, args)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=1))
    if args.grpc:
        by = {r["policy"]: r["hit"] for r in results}
        print(f"bench_scaleout: grpc: cache_aware={_pct(by.get('cache_aware+grpc'))} http "
              f"cache_aware={_pct(by.get('cache_aware'))} (decode workers' SubscribeKvEvents "
              f"streams: {calls['all'] - calls['UNIMPLEMENTED']} ended, {calls['UNIMPLEMENTED']} "
              f"unimplemented)",
              flush=True)
    single = results[0]["hit"]
    cache_aware = next((r["hit"] for r in results if r["policy"] == "cache_aware"), None)
    best = max(results[1:], key=lambda r: r["hit"])
    print(f"bench_scaleout: workers={args.workers} single={_pct(single)} "
          f"cache_aware={_pct(cache_aware)} best={best['policy']}:{_pct(best['hit'])}",
          flush=True)
    return 0


def run_all(stack: Stack, args: argparse.Namespace, policies: list[str]) -> list[dict[str, Any]]:
    """The single-worker run, then one run per policy over all the decode workers."""
    users = user_turns(args.conversations, args.turns, args.seed)
    model = stack.model_name()
    plan = [("single", "round_robin", 1, False)] + [(p, p, args.workers, False)
                                                      for p in policies]
    if args.grpc:
        plan.append(("cache_aware+grpc", "cache_aware", args.workers, True))
    results = []
    for label, policy, n, grpc in plan:
        stack.flush()
        before, finished = stack.served(), sum(stack.served("finished"))
        keyed = policy == "manual" or args.sticky
        t0 = time.monotonic()
        extra = shlex.split(args.router_args) if n > 1 else []
        if args.sticky and n > 1 and policy != "manual":
            extra.append("--routing-key-override")
        with stack.routed(policy, n, extra, grpc=grpc) as router:
            turns = play(router.url, model, users, args.max_tokens,
                         (lambda i: f"conversation-{i}") if keyed else (lambda _: None),
                         completions=args.grpc)
        seconds = time.monotonic() - t0
        per_worker = [b - a for a, b in zip(before, stack.served(), strict=True)][:n]
        # requests a decode worker ended otherwise (aborted, failed) and the router retried
        retried = sum(per_worker) - (sum(stack.served("finished")) - finished)
        results.append({
            "policy": label, "workers": n, "hit": later_turn_hit(turns),
            "requests_per_worker": per_worker, "not_finished": retried,
            "seconds": round(seconds, 1),
            "ttft_p50_ms": p50_ms([t.ttft_s for t in turns]),
            "tpot_p50_ms": p50_ms([t.tpot_s for t in turns]),
            "first_turn_hit": hit_rate([t for t in turns if t.turn == 0]),
        })
        print(f"bench_scaleout: {label}: hit {_pct(results[-1]['hit'])} requests "
              f"{per_worker} ({retried} not finished) in {seconds:.1f}s", file=sys.stderr,
              flush=True)
    return results


def _print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    pools = f"{args.pool_pages} pages per pool" if args.pool_pages else "default pools"
    flags = f", router flags {args.router_args!r}" if args.router_args else ""
    print(f"bench_scaleout: {args.router}{flags}, {args.conversations} conversations x "
          f"{args.turns} turns, {args.max_tokens} output tokens per turn, {pools}")
    print(f"{'decode policy':<14} {'workers':>7} {'later-turn hit':>14} {'turn-1 hit':>10} "
          f"{'requests per worker':<20} {'retried':>7} {'TTFT p50 ms':>11} {'TPOT p50 ms':>11}")
    for r in results:
        shares = " / ".join(str(n) for n in r["requests_per_worker"])
        print(f"{r['policy']:<14} {r['workers']:>7} {_pct(r['hit']):>14} "
              f"{_pct(r['first_turn_hit']):>10} {shares:<20} {r['not_finished']:>7} "
              f"{r['ttft_p50_ms']:>11.1f} {r['tpot_p50_ms']:>11.1f}")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100.0 * x:.1f}%"


def _tiny_model() -> Path:
    from decode_worker.device.default_model import write_model

    return Path(write_model(Path(tempfile.mkdtemp(prefix="scaleout-")) / "tiny-gpt-oss",
                            seed=0))


if __name__ == "__main__":
    raise SystemExit(main())
