"""Host-tier benchmark: how much later-turn reuse a host tier keeps when the conversations
outgrow the device pool, and how fast its restores copy.

    python scripts/bench_host_tier.py [--chats 32 --turns 5 --concurrency 4]
    python -m scripts.bench_host_tier

Interleaved multi-turn chats, generated locally from `--seed` (`host_tier_lib/workload.py`),
whose working set (every conversation's KV, in full pages) is `--device-ratio` (3) times the
small device pool and fits the host pool (`--host-ratio` x the working set). Each run drives
one decode worker's real core (`host_tier_lib/worker.py`: `PreallocQueue` admission with its
rules, so host hits count only when locked at admission; `DecodeAllocator`; the
`UnifiedRadixTree`) and, with the host tier, the real `HostKVPool` on the real KV pool layout of
the built-in tiny model (`--layout gpt-oss-20b` for that model's page shape). Runs:

- unbounded: a device pool that holds everything;
- device only: the small device pool, no host tier;
- host tier: the small device pool with the host tier, once per write policy (the settings'
  default policy gives the host_tier numbers).

Reported per run: the later-turn hit rate (prompt tokens advertised as reused at each turn's
first admission, device + host hits, over the prompt tokens of turns 2..T), the KV bytes the
prefill sends (full layers past the reused prefix, SWA layers past the window start; every
admission, retractions included), evictions, retractions, bytes written to the host. The
restore bandwidth is the bytes of every real `HostKVPool.restore` over their time (the whole
call: planning the copies included), beside a plain copy of the same bytes made right after
each: one contiguous `torch` `copy_` of as many bytes, between two buffers as large as the host
pool (256 MB at most) used round-robin (as cold as the pools' pages), timed the same way
(process CPU time). Their ratio is printed (goal on CPU: at least 0.5). On the tiny layout a
restore is a few hundred KB, so fixed per-call costs weigh; `--layout gpt-oss-20b` shows the
copy itself.
Every restored page is checked bit-exact against what was written. The last line is exactly

    bench_host_tier: unbounded_hit=<x> device_only_hit=<x> host_tier_hit=<x> \
kv_bytes_saved=<pct> restore_gbps=<x>

(one line; `kv_bytes_saved`: KV bytes the prefill sends with the host tier vs device only,
saved, in percent with one decimal). Goal: host_tier_hit >= 0.95 x unbounded_hit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from decode_worker.core.host_tier import WritePolicy
from decode_worker.device.default_model import tiny_config
from decode_worker.device.kv_pool import KVSpec
from decode_worker.settings import CacheSettings
from decode_worker.utils.mathx import cdiv
from scripts.host_tier_lib.worker import Result, Setup, Worker
from scripts.host_tier_lib.workload import Shape, make_chats, working_set_pages

TIE = 0.005  # hit rates closer than this are a tie: the policy writing fewer bytes wins


def layout(name: str) -> tuple[KVSpec, torch.dtype]:
    """The KV pool shape: the built-in tiny model, or gpt-oss-20b's (24 layers alternating
    sliding/full, 8 KV heads of 64, bfloat16)."""
    if name == "tiny":
        cfg = tiny_config()
        return (KVSpec(tuple(cfg["layer_types"]), cfg["num_key_value_heads"], cfg["head_dim"]),
                torch.float32)
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24))
    return KVSpec(types, 8, 64), torch.bfloat16


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_host_tier", description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--systems", type=int, default=2, help="system prompts the chats share")
    ap.add_argument("--system-len", type=int, default=200)
    ap.add_argument("--user-len", type=int, nargs=2, default=[40, 200], metavar=("MIN", "MAX"))
    ap.add_argument("--answer-len", type=int, nargs=2, default=[40, 160], metavar=("MIN", "MAX"))
    ap.add_argument("--concurrency", type=int, default=4, help="requests holding pages at once")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=127, help="tokens (HF sliding_window - 1)")
    ap.add_argument("--device-ratio", type=float, default=3.0,
                    help="working set / small device pool")
    ap.add_argument("--host-ratio", type=float, default=1.25, help="host pool / working set")
    ap.add_argument("--layout", choices=("tiny", "gpt-oss-20b"), default="tiny")
    ap.add_argument("--policies", nargs="+", default=[p.value for p in WritePolicy],
                    choices=[p.value for p in WritePolicy])
    ap.add_argument("--check-every", type=int, default=0,
                    help="check the tree's integrity every N steps (0: at the end of each run)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (two on a shared 2-core box stall small copies)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.turns < 2 or args.chats < 1 or args.concurrency < 1 or args.device_ratio <= 1:
        ap.error("needs --turns >= 2, --chats >= 1, --concurrency >= 1, --device-ratio > 1")
    return args


def run(args: argparse.Namespace) -> tuple[list[Result], dict[str, Result], str]:
    """The three runs and the per-policy runs; returns (rows, per policy, default policy)."""
    shape = Shape(args.chats, args.turns, args.systems, args.system_len,
                  tuple(args.user_len), tuple(args.answer_len))
    chats = make_chats(shape, args.seed)
    spec, dtype = layout(args.layout)
    ps = args.page_size
    ws = working_set_pages(chats, ps)
    longest = max(cdiv(c.final_len(), ps) for c in chats)
    small = int(ws // args.device_ratio)
    host = int(ws * args.host_ratio)
    default = CacheSettings().hicache_write_policy
    policies = sorted(args.policies, key=lambda p: p != default)  # the default first

    def one(setup: Setup) -> Result:
        t0 = time.perf_counter()
        res = Worker(setup, spec, ps, args.window, args.concurrency, dtype,
                     args.check_every).run(chats)
        res.extra["wall_s"] = time.perf_counter() - t0
        return res

    rows = [one(Setup("unbounded", ws + args.concurrency * (longest + 32) + 64)),
            one(Setup("device only", small))]
    per_policy = {p: one(Setup(f"host tier ({p})", small, host, WritePolicy(p)))
                  for p in policies}
    rows += per_policy.values()
    print(f"bench_host_tier: {args.chats} chats x {args.turns} turns, {args.concurrency} at "
          f"a time; page {ps}, window {args.window}; {args.layout} layout "
          f"({spec.num_full_layers} full + {spec.num_swa_layers} SWA layers, "
          f"{spec.page_bytes(ps, dtype) * spec.num_full_layers} B per full page); working set "
          f"{ws} pages (longest chat {longest}); small device pool {small} pages, host pool "
          f"{host} pages (hicache_ratio {host / small:.2f})")
    return rows, per_policy, default


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def print_rows(rows: list[Result]) -> None:
    print(f"{'run':<34} {'device':>6} {'host':>5} {'later-turn hit':>14} {'of it host':>10} "
          f"{'KV sent MB':>10} {'evicted':>7} {'retracted':>9} {'to host MB':>10} "
          f"{'at evict MB':>11} {'write ms':>8} {'run s':>6}")
    for r in rows:
        s = r.setup
        print(f"{s.label:<34} {s.device_pages:>6} {s.host_pages:>5} {r.hit:>14.3f} "
              f"{r.later_host_tokens / max(1, r.later_prompt_tokens):>10.3f} "
              f"{_mb(r.sent_bytes):>10} {r.evicted_pages:>7} {r.retractions:>9} "
              f"{_mb(r.written_bytes):>10} {_mb(r.evict_written_bytes):>11} "
              f"{r.write_s * 1e3:>8.1f} {r.extra['wall_s']:>6.1f}")


def best_policy(per_policy: dict[str, Result]) -> tuple[str, str]:
    """The policy with the highest hit rate; among those within `TIE` of it, the one whose
    copies delay the reuse of evicted pages least (bytes written at device eviction: a
    transfer into the freed pages waits for them), then the one writing fewest bytes.
    Returns (policy, why)."""
    top = max(r.hit for r in per_policy.values())
    close = [p for p, r in per_policy.items() if r.hit >= top - TIE]
    best = min(close, key=lambda p: (per_policy[p].evict_written_bytes,
                                     per_policy[p].written_bytes))
    b = per_policy[best]

    def desc(r: Result) -> str:
        return (f"hit {r.hit:.3f}, {_mb(r.written_bytes)} MB written, "
                f"{_mb(r.evict_written_bytes)} MB of it at eviction")

    others = "; ".join(f"{p}: {desc(r)}" for p, r in per_policy.items() if p != best)
    why = (f"{desc(b)} (others: {others}); hit rates within {TIE} tie, then fewer bytes "
           "copied at eviction win (a transfer into freed pages waits for them), then fewer "
           "bytes")
    return best, why


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    rows, per_policy, default = run(args)
    print_rows(rows)
    unb, dev, host = rows[0], rows[1], per_policy[default]
    restore_gbps = host.restore_bytes / max(host.restore_s, 1e-12) / 1e9
    copy_gbps = host.restore_bytes / max(host.copy_s, 1e-12) / 1e9
    ratio = restore_gbps / max(copy_gbps, 1e-12)
    print(f"restore ({default}): {host.restores} restores of {_mb(host.restore_bytes)} MB, "
          f"every page bit-exact; HostKVPool.restore {restore_gbps:.2f} GB/s, plain torch copy "
          f"of the same bytes {copy_gbps:.2f} GB/s (ratio restore / plain copy {ratio:.2f}, "
          f"goal >= 0.5)")
    saved = 100.0 * (1.0 - host.sent_bytes / max(1, dev.sent_bytes))
    print(f"host tier keeps {host.hit / max(unb.hit, 1e-12):.1%} of the unbounded hit rate "
          f"(goal >= 95%); the prefill sends {saved:.1f}% fewer KV bytes than device only")
    if len(per_policy) > 1:
        best, why = best_policy(per_policy)
        print(f"best write policy: {best}: {why}; the settings default is {default}")
    print(f"bench_host_tier: unbounded_hit={unb.hit:.3f} device_only_hit={dev.hit:.3f} "
          f"host_tier_hit={host.hit:.3f} kv_bytes_saved={saved:.1f}% "
          f"restore_gbps={restore_gbps:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
