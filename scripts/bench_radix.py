"""Benchmark the unified radix tree on a multi-turn chat trace (pure Python, one core).

Trace: `--systems` shared system prompts of `--system-len` tokens; conversations of `--turns`
turns (user message 30-300 tokens, answer 50-400 tokens); turn t's prompt is the system prompt
plus the whole history. Conversations are shuffled within each turn. Each request does what the
decode worker does: page keys once, a TRANSFER match capped at the window start S, a lock,
allocation of the delta and the SWA tail (evicting when short), `cache_unfinished_req`, decoding
its answer (freeing out-of-window SWA pages), `cache_finished_req`. Token lists are fresh int
objects per request (as decoded from the wire). Times are CPU time (`process_time`).

Reports per page size:
- scaling runs (`--scales`, cached tokens at the end): per-request key cost and match / insert
  (`cache_unfinished_req`) / finish (`cache_finished_req`) throughput over the last quarter of the
  requests (cache near its final size), in ops/s and prompt tokens/s;
- at `--reuse-scale`, without and with eviction pressure (`--pressure`): throughput over the
  whole run (all turns, timed without probes), then in a second run with untimed probes the
  reuse: prompt tokens the TRANSFER match reuses vs the full-attention bound (the full-resident
  prefix, uncapped) and vs a window-safe match (SGLang's rule: the deepest node with a live SWA
  window, capped at S);
- memory (`--memory-scale`): tracemalloc of the tree and pools at the end, and the peak.
`--compare-sglang` runs only the side-by-side run against SGLang (`bench_radix_sglang.py`).
`--compare-host-tier` runs only the tree without and with a host tier that sees no traffic
(write_back, no eviction), interleaved in one run: the host tier must cost nothing unused.
`--kv-events` builds the tree recording KV events, taken (not read) after each request, as the
engine's compute thread does; reading them (hashing, encoding) is the publisher thread's work.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from array import array
from dataclasses import dataclass, field

from decode_worker.core.host_tier import HostWrite, WritePolicy
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_node import page_keys
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.utils.mathx import align_down, cdiv


@dataclass
class Stats:
    keys_s: float = 0.0
    match_s: float = 0.0
    insert_s: float = 0.0
    finish_s: float = 0.0
    n_req: int = 0
    prompt_tokens: int = 0
    reused: int = 0
    bound: int = 0
    window_safe: int = 0
    evicted_full: int = 0
    evicted_swa: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def make_trace(args: argparse.Namespace, n_convs: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, the token lists of each turn: [system, user_1, answer_1, user_2, ...].
    Tokens are uniform in [0, 65536)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return array("H", rng.randbytes(2 * n)).tolist()

    systems = [tokens(args.system_len) for _ in range(args.systems)]
    convs = []
    for _ in range(n_convs):
        parts = [rng.choice(systems)]
        for _ in range(args.turns):
            parts.append(tokens(rng.randint(30, 300)))
            parts.append(tokens(rng.randint(50, 400)))
        convs.append(parts)
    return convs


def window_start(seq_len: int, window: int, ps: int) -> int:
    return align_down(max(0, seq_len - 1 - max(window, ps)), ps)


def alloc(tree: UnifiedRadixTree, n: int, *, swa: bool, st: Stats) -> list[int]:
    pool = tree.swa if swa else tree.full
    assert pool is not None
    short = n - pool.num_free
    if short > 0:
        got = tree.evict_swa(short) if swa else tree.evict_full(short)
        if swa:
            st.evicted_swa += len(got)
        else:
            st.evicted_full += len(got)
    return pool.alloc(n)


def run_request(tree: UnifiedRadixTree, prompt: list[int], answer: list[int], st: Stats) -> None:
    ps, win = tree.page_size, tree.window
    s = window_start(len(prompt), win, ps)
    t0 = time.process_time()
    keys = page_keys(prompt, ps)  # once per request, reused by match and both inserts
    t1 = time.process_time()
    res = tree.match_prefix(prompt, MatchMode.TRANSFER, max_len=s, keys=keys)
    st.match_s += time.process_time() - t1
    st.keys_s += t1 - t0
    lock = tree.lock(res.node)
    n_pages = cdiv(len(prompt), ps)
    full = res.full_page_ids + alloc(tree, n_pages - res.prefix_len // ps, swa=False, st=st)
    swa = [0] * (s // ps) + alloc(tree, n_pages - s // ps, swa=True, st=st)
    kv = ReqKV(prompt, full, swa, s, res.prefix_len, lock, page_keys=keys)
    t0 = time.process_time()
    tree.cache_unfinished_req(kv)
    st.insert_s += time.process_time() - t0
    decode(tree, kv, answer, st)
    t0 = time.process_time()
    tree.cache_finished_req(kv)
    st.finish_s += time.process_time() - t0
    st.n_req += 1
    st.prompt_tokens += len(prompt)
    st.reused += res.prefix_len


def decode(tree: UnifiedRadixTree, kv: ReqKV, answer: list[int], st: Stats) -> None:
    """Append the answer in one step: new pages, then free the request's out-of-window SWA."""
    ps = tree.page_size
    need = cdiv(len(kv.token_ids) + len(answer), ps) - len(kv.full_page_ids)
    kv.full_page_ids += alloc(tree, need, swa=False, st=st)
    kv.swa_page_ids += alloc(tree, need, swa=True, st=st)
    kv.token_ids += answer
    frontier = window_start(len(kv.token_ids), tree.window, ps)
    lo = max(kv.swa_start, kv.cache_protected_len) // ps
    old = [p for p in kv.swa_page_ids[lo : frontier // ps] if p]
    assert tree.swa is not None
    tree.swa.free(old)
    kv.swa_page_ids[lo : frontier // ps] = [0] * max(0, frontier // ps - lo)
    kv.swa_start = max(kv.swa_start, frontier)


def measure_reuse(tree: UnifiedRadixTree, prompt: list[int], st: Stats) -> None:
    """Untimed: the full-attention bound and the window-safe (SGLang-rule) match."""
    s = window_start(len(prompt), tree.window, tree.page_size)
    st.bound += tree.match_prefix(prompt, MatchMode.TRANSFER).prefix_len
    st.window_safe += min(s, tree.match_prefix(prompt, MatchMode.RESUME).prefix_len)


def run_trace(
    args: argparse.Namespace, ps: int, n_convs: int, pool_frac: float | None,
    host_policy: WritePolicy | None = None,
) -> tuple[Stats, Stats, int]:
    """Run the trace turn by turn (conversations shuffled within a turn).

    Returns (stats over all requests, stats over the last quarter, cached tokens at the end);
    `pool_frac` sizes the full pool as a share of the pages the whole trace needs (None: no
    eviction). The SWA pool gets a quarter of the full pool. `host_policy`: with a host tier
    of that write policy (twice the full pool; its copies are dropped: the shell makes them)."""
    convs = make_trace(args, n_convs, args.seed)
    gc.collect()
    gc.freeze()  # the trace is not the tree's garbage to scan
    if args.memory:
        tracemalloc.start()
    need = sum(cdiv(sum(map(len, c)), ps) + 1 for c in convs) + 64
    n_full = need if pool_frac is None else max(64, int(need * pool_frac))
    full, swa = PageAllocator(n_full, "full"), PageAllocator(max(64, n_full // 4), "swa")
    host = PageAllocator(2 * n_full, "host") if host_policy is not None else None
    tree = UnifiedRadixTree(ps, args.window, full, swa, host=host, kv_events=args.kv_events,
                            write_policy=host_policy or WritePolicy.WRITE_THROUGH)
    if host is not None:
        tree.write_sink = _count_write
    whole, tail = Stats(), Stats()
    order = list(range(n_convs))
    rng = random.Random(args.seed + 1)
    done, n_total = 0, n_convs * args.turns
    for turn in range(args.turns):
        rng.shuffle(order)
        for c in order:
            parts = convs[c]
            # fresh int objects, as decoded from the wire (no identity shortcuts in compares)
            prompt = array("q", [t for part in parts[: 2 * turn + 2] for t in part]).tolist()
            one = Stats()
            if args.reuse:
                measure_reuse(tree, prompt, one)
            run_request(tree, prompt, parts[2 * turn + 2], one)
            tree.take_events()  # the engine's publish_step (the log keeps them; not here)
            merge(whole, one)
            if done >= n_total * 3 // 4:
                merge(tail, one)
            done += 1
    if args.memory:
        cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        whole.extra.update(tree_bytes=cur, peak_bytes=peak)
    tree.check_integrity()
    gc.unfreeze()
    fs = tree.full_stats()
    return whole, tail, (fs.evictable + fs.protected) * ps


_HOST_WRITES = [0]  # pages the tree asked to copy to the host (the bench drops the copies)


def _count_write(job: HostWrite) -> None:
    _HOST_WRITES[0] += len(job.host_page_ids)


def compare_host_tier(args: argparse.Namespace) -> None:
    """Tree cost with the host tier off and on without host traffic (write_back, no eviction:
    nothing is ever copied), in the same run: `--host-reps` pairs of runs back to back, the
    pair's order alternating, and the median of the pairs' ratios (this machine's speed
    drifts more than 3 % over seconds). Then write_through for reference (every insert
    queues a copy: traffic)."""
    for ps in args.page_sizes:
        n_convs = max(1, round(args.reuse_scale / conv_tokens(args)))
        args.reuse = False
        sides: dict[str, list[Stats]] = {"off": [], "on": [], "write_through": []}
        for rep in range(args.host_reps):
            runs = [("off", None), ("on", WritePolicy.WRITE_BACK),
                    ("write_through", WritePolicy.WRITE_THROUGH)]
            for label, policy in runs if rep % 2 == 0 else runs[::-1]:
                _HOST_WRITES[0] = 0
                whole, _, _ = run_trace(args, ps, n_convs, None, policy)
                if label == "on" and _HOST_WRITES[0]:
                    raise SystemExit("bench_radix: host traffic in the no-traffic run")
                sides[label].append(whole)
        med = {k: _median_cost(v) for k, v in sides.items()}
        for label in ("off", "on", "write_through"):
            m = med[label]
            ratio = "" if label == "off" else f"  (x{_paired(sides[label], sides['off']):.3f})"
            print(f"host tier {label:<13} page {ps:>2}: match {m[0]:>6.2f} insert {m[1]:>6.2f} "
                  f"finish {m[2]:>6.2f} total {m[3]:>6.2f} us/req{ratio}")
        print(f"bench_radix host tier: page {ps} no-traffic cost ratio "
              f"{_paired(sides['on'], sides['off']):.3f} (median of {args.host_reps} pairs; "
              "goal <= 1.03)")


def _paired(on: list[Stats], off: list[Stats]) -> float:
    """Median over the pairs of on's total cost / off's."""
    return statistics.median(_median_cost([a])[3] / _median_cost([b])[3]
                             for a, b in zip(on, off, strict=True))


def _median_cost(runs: list[Stats]) -> tuple[float, float, float, float]:
    """Median us per request of match, insert, finish and their sum."""
    def us(st: Stats, s: float) -> float:
        return s / max(1, st.n_req) * 1e6

    rows = [(us(st, st.match_s), us(st, st.insert_s), us(st, st.finish_s),
             us(st, st.match_s + st.insert_s + st.finish_s + st.keys_s)) for st in runs]
    return tuple(statistics.median(col) for col in zip(*rows, strict=True))  # type: ignore[return-value]


def merge(into: Stats, one: Stats) -> None:
    for k in ("keys_s", "match_s", "insert_s", "finish_s", "n_req", "prompt_tokens", "reused",
              "bound", "window_safe", "evicted_full", "evicted_swa"):
        setattr(into, k, getattr(into, k) + getattr(one, k))


def report(label: str, st: Stats, cached: int) -> None:
    n, toks = st.n_req, st.prompt_tokens
    print(
        f"{label:<14} cached {cached / 1e3:>5.0f}k tok | keys {st.keys_s / n * 1e6:>5.1f} us/req | "
        f"match {n / st.match_s:>6.0f}/s {toks / st.match_s / 1e6:>5.0f}M tok/s | "
        f"insert {n / st.insert_s:>6.0f}/s {toks / st.insert_s / 1e6:>5.0f}M tok/s | "
        f"finish {n / st.finish_s:>6.0f}/s"
    )


def report_reuse(label: str, st: Stats) -> None:
    pt = max(1, st.prompt_tokens)
    print(
        f"{label:<14} reuse: transfer {st.reused / pt:6.1%} | full bound {st.bound / pt:6.1%} | "
        f"window-safe {st.window_safe / pt:6.1%} | evicted full {st.evicted_full} "
        f"swa {st.evicted_swa} pages"
    )


def conv_tokens(args: argparse.Namespace) -> float:
    """Mean unique tokens one conversation adds to the cache (its turns, not the system)."""
    return args.turns * (165 + 225)


def compare(args: argparse.Namespace) -> None:
    from scripts.bench_radix_sglang import run_compare, sglang_missing

    why = sglang_missing()
    if why:
        raise SystemExit(why)
    run_compare(args, make_trace(args, max(1, round(args.compare_scale / conv_tokens(args))),
                                 args.seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--scales", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                    help="cached-token targets for the scaling runs")
    ap.add_argument("--window", type=int, default=127, help="tokens (HF sliding_window - 1)")
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--pressure", type=float, default=0.25,
                    help="full pool as a share of what the trace needs, for the eviction run")
    ap.add_argument("--reuse-scale", type=int, default=100_000)
    ap.add_argument("--memory-scale", type=int, default=300_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-events", action="store_true", help="the tree records KV events")
    ap.add_argument("--compare-sglang", action="store_true",
                    help="only the side-by-side run against SGLang 0.5.23's tree "
                    "(scripts/bench_radix_sglang.py says how to run it)")
    ap.add_argument("--compare-scale", type=int, default=1_000_000, help="tokens of that trace")
    ap.add_argument("--compare-page-size", type=int, default=64)
    ap.add_argument("--sglang-pool", type=float, default=0.6,
                    help="full pool as a share of what that trace needs (eviction)")
    ap.add_argument("--sglang-reps", type=int, default=2, help="alternating runs of each")
    ap.add_argument("--compare-host-tier", action="store_true",
                    help="only the host tier off vs on without host traffic, at --reuse-scale")
    ap.add_argument("--host-reps", type=int, default=9, help="interleaved runs of each side")
    args = ap.parse_args()
    args.memory = False
    if args.compare_sglang:
        compare(args)
        return
    if args.compare_host_tier:
        compare_host_tier(args)
        return
    for ps in args.page_sizes:
        print(f"--- page size {ps}, window {args.window} ---")
        args.reuse = False
        for scale in args.scales:
            _, tail, cached = run_trace(args, ps, max(1, round(scale / conv_tokens(args))), None)
            report(f"scale {scale // 1000}k", tail, cached)
        n_convs = max(1, round(args.reuse_scale / conv_tokens(args)))
        for label, frac in (("no eviction", None), (f"pool {args.pressure:.0%}", args.pressure)):
            args.reuse = False  # timed without the reuse probes (they would pre-split nodes)
            whole, _, cached = run_trace(args, ps, n_convs, frac)
            report(label, whole, cached)
            args.reuse = True
            whole, _, cached = run_trace(args, ps, n_convs, frac)
            report_reuse(label, whole)
        args.reuse, args.memory = False, True
        n_convs = round(args.memory_scale / conv_tokens(args))
        whole, _, cached = run_trace(args, ps, n_convs, None)
        args.memory = False
        cur, peak = whole.extra["tree_bytes"], whole.extra["peak_bytes"]
        print(
            f"{'memory':<14} cached {cached / 1e3:>6.0f}k tok | tree+pools {cur / 2**20:.1f} MiB"
            f" ({cur / max(1, cached):.1f} B/cached token) | peak while running "
            f"{peak / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
