# mypy: disable-error-code="import-not-found"
"""`bench_radix.py --compare-sglang`: our unified radix tree and SGLang 0.5.23's
`UnifiedRadixCache` (FULL + SWA, Rust tree core, window 127, real `SWAKVPool` and
`SWATokenToKVPoolAllocator`) on the same chat trace, in the same process.

Run it under SGLang's virtual environment with this package importable (`setup_sglang.sh`):
    PYTHONPATH=. .venv-sglang/bin/python -m scripts.bench_radix --compare-sglang

Both sides run one flow per request, as a decode worker with a radix cache does: a match capped
at the window start S (SGLang: `RadixKey(limit=S)`, its decode-side cap), a lock on the match, at
finish the missing full pages `[prefix, end)` and SWA pages for the live window
`[frontier, end)` (evicting first when a pool is short), one insert of the page-aligned KV with
the reused prefix (duplicates freed by the tree), unlock, and the unaligned tail freed. Pools are
the same page counts on both sides: full at `--sglang-pool` of the pages the trace needs, SWA at
0.8 x full (SGLang's default ratio). Times are CPU time (`process_time`), one torch thread, and
the two implementations alternate whole runs (`--sglang-reps` each); the best run of each counts.

What is timed (per request, prebuilt keys on both sides, as each request carries them):
- match: ours `match_prefix(keys=...)` (returns the prefix's page ids too); SGLang's
  `match_prefix` (its prefix's indices need `path_device_indices`, printed beside, not counted);
- insert: ours `cache_finished_req` (insert + tail free + unlock); SGLang's `insert` + `unlock`
  + the tail free;
- keys, printed beside: ours `page_keys` of the token list (pack + slices), SGLang's
  `array("q", tokens)`.
Reuse: the share of prompt tokens matched (SGLang needs a live SWA window at the match end;
ours reuses full KV only, the SWA tail arrives fresh). The last line prints the ratios.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from array import array
from dataclasses import dataclass
from typing import Any

from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_node import page_keys
from decode_worker.core.radix_tree import MatchMode, UnifiedRadixTree
from decode_worker.core.req_kv import ReqKV
from decode_worker.utils.mathx import cdiv

Trace = list[tuple[list[int], list[int]]]  # (prompt, answer) per request, in order


@dataclass
class Times:
    keys_s: float = 0.0
    match_s: float = 0.0
    extra_s: float = 0.0  # SGLang: prefix indices after the match
    insert_s: float = 0.0
    n_req: int = 0
    prompt_tokens: int = 0
    reused: int = 0


def window_start(seq_len: int, window: int, ps: int) -> int:
    return max(0, seq_len - 1 - max(window, ps)) // ps * ps


class Ours:
    """Our tree on `n_full` / `n_swa` pages."""

    name = "ours"

    def __init__(self, ps: int, window: int, n_full: int, n_swa: int) -> None:
        self.full, self.swa = PageAllocator(n_full, "full"), PageAllocator(n_swa, "swa")
        self.tree = UnifiedRadixTree(ps, window, self.full, self.swa)

    def _alloc(self, pool: PageAllocator, n: int) -> list[int]:
        short = n - pool.num_free
        if short > 0:
            (self.tree.evict_swa if pool is self.swa else self.tree.evict_full)(short)
        return pool.alloc(n)

    def run(self, prompt: list[int], answer: list[int], t: Times) -> None:
        tree, ps, clock = self.tree, self.tree.page_size, time.process_time
        s = window_start(len(prompt), tree.window, ps)
        t0 = clock()
        keys = page_keys(prompt, ps)
        t1 = clock()
        res = tree.match_prefix((), MatchMode.TRANSFER, s, keys=keys)
        t2 = clock()
        lock = tree.lock(res.node)
        tokens = prompt + answer
        end = len(tokens)
        n_pages, front = cdiv(end, ps), window_start(end, tree.window, ps) // ps
        full = res.full_page_ids + self._alloc(self.full, n_pages - res.prefix_len // ps)
        swa = [0] * front + self._alloc(self.swa, n_pages - front)
        kv = ReqKV(tokens, full, swa, front * ps, res.prefix_len, lock, keys[:])
        kv.keys(ps)  # the answer's pages: built as it decoded (not timed, as for SGLang)
        t3 = clock()
        tree.cache_finished_req(kv)
        t4 = clock()
        t.keys_s += t1 - t0
        t.match_s += t2 - t1
        t.insert_s += t4 - t3
        t.n_req += 1
        t.prompt_tokens += len(prompt)
        t.reused += res.prefix_len

    def check(self) -> None:
        self.tree.check_integrity()


class Sglang:
    """SGLang 0.5.23's `UnifiedRadixCache` (Rust core) on the same page counts."""

    name = "sglang"

    def __init__(self, ps: int, window: int, n_full: int, n_swa: int) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        torch.set_num_threads(1)  # two threads on a shared 2-core box stall cat/sort calls
        size, size_swa = n_full * ps, n_swa * ps
        pool = SWAKVPool(size, size_swa, ps, torch.bfloat16, 1, 8, swa_attention_layer_ids=[0],
                         full_attention_layer_ids=[1], device="cpu")
        self.alloc = SWATokenToKVPoolAllocator(size, size_swa, ps, torch.bfloat16, device="cpu",
                                               kvcache=pool, need_sort=True)
        self.tree = UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
            page_size=ps, sliding_window_size=window,
            tree_components=(ComponentType.FULL, ComponentType.SWA), tree_core_backend="rust"))
        assert type(self.tree.tree_core).__name__.startswith("Rust"), "not the Rust tree core"
        self.ps, self.window, self.torch, self.swa_type = ps, window, torch, ComponentType.SWA

    def _alloc(self, n_full: int, n_swa: int) -> tuple[Any, Any]:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        fa, sa = self.alloc.full_attn_allocator, self.alloc.swa_attn_allocator
        short_full, short_swa = n_full - fa.available_size(), n_swa - sa.available_size()
        if short_full > 0 or short_swa > 0:
            self.tree.evict(EvictParams(num_tokens=max(0, short_full),
                                        swa_num_tokens=max(0, short_swa)))
        full, swa = fa.alloc(n_full), sa.alloc(n_swa)
        if full is None or swa is None:
            raise RuntimeError(f"sglang: no room for {n_full} full / {n_swa} SWA tokens")
        return full, swa

    def run(self, prompt: list[int], answer: list[int], t: Times) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        tree, ps, clock, torch = self.tree, self.ps, time.process_time, self.torch
        s = window_start(len(prompt), self.window, ps)
        t0 = clock()
        ids = array("q", prompt)
        t1 = clock()
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(ids, limit=s)))
        t2 = clock()
        prefix, node = m.device_prefix_len, m.last_device_node
        prefix_idx = tree.path_device_indices(node)[:prefix]
        t3 = clock()
        lock = tree.lock(node)
        tokens = array("q", prompt + answer)
        end = len(tokens)
        n_pages, front = cdiv(end, ps), window_start(end, self.window, ps)
        new_full, new_swa = self._alloc(n_pages * ps - prefix, n_pages * ps - front)
        full = torch.cat([prefix_idx.to(torch.int64), new_full.to(torch.int64)])
        self.alloc.set_full_to_swa_mapping(full[front:], new_swa)
        aligned = end // ps * ps
        params = InsertParams(key=RadixKey(tokens[:aligned]), value=full[:aligned].clone(),
                              prev_prefix_len=prefix,
                              component_evicted_seqlens={self.swa_type: front})
        t4 = clock()
        tree.insert(params)
        tree.unlock(lock)
        if aligned < n_pages * ps:
            self.alloc.free(full[aligned:])
        t5 = clock()
        t.keys_s += t1 - t0
        t.match_s += t2 - t1
        t.extra_s += t3 - t2
        t.insert_s += t5 - t4
        t.n_req += 1
        t.prompt_tokens += len(prompt)
        t.reused += prefix

    def check(self) -> None:
        self.tree.sanity_check()


def sglang_missing() -> str:
    """Why SGLang's tree cannot run here ('' when it can)."""
    try:
        import sglang  # noqa: F401
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401
    except ImportError as e:
        return (f"--compare-sglang needs sglang 0.5.23 importable ({e}); run it as "
                "PYTHONPATH=. .venv-sglang/bin/python -m scripts.bench_radix --compare-sglang "
                "(scripts/setup_sglang.sh builds .venv-sglang)")
    return ""


def requests(convs: list[list[list[int]]], turns: int, seed: int) -> Any:
    """(prompt, answer) per request, turn by turn, conversations shuffled within a turn (the
    order `bench_radix.run_trace` uses); prompts are fresh int lists, as decoded from the wire."""
    import random

    order = list(range(len(convs)))
    rng = random.Random(seed + 1)
    for turn in range(turns):
        rng.shuffle(order)
        for c in order:
            parts = convs[c]
            prompt = array("q", [t for part in parts[: 2 * turn + 2] for t in part]).tolist()
            yield prompt, parts[2 * turn + 2]


def run_compare(args: argparse.Namespace, convs: list[list[list[int]]]) -> None:
    """Alternate whole runs of both trees on the trace; print each one's best and the ratios."""
    ps, win = args.compare_page_size, args.window
    need = sum(cdiv(sum(map(len, c)), ps) + 1 for c in convs) + 64
    n_full = max(64, int(need * args.sglang_pool))
    n_swa = max(64, int(n_full * 0.8))
    tokens = sum(map(len, (t for c in convs for t in c[1:]))) + args.systems * args.system_len
    print(f"--- vs SGLang: {len(convs)} conversations x {args.turns} turns, {tokens / 1e6:.2f}M "
          f"unique tokens, page {ps}, window {win}, full pool {n_full} pages "
          f"({args.sglang_pool:.0%} of the trace), SWA pool {n_swa} ---")
    best: dict[str, Times] = {}
    for _ in range(args.sglang_reps):
        for cls in (Ours, Sglang):
            impl = cls(ps, win, n_full, n_swa)
            t = Times()
            gc.collect()
            for prompt, answer in requests(convs, args.turns, args.seed):
                impl.run(prompt, answer, t)
            impl.check()
            old = best.get(impl.name)
            if old is None or t.match_s + t.insert_s < old.match_s + old.insert_s:
                best[impl.name] = t
    for name, t in best.items():
        _report(name, t)
    o, s = best["ours"], best["sglang"]
    both = (s.match_s + s.keys_s) / (o.match_s + o.keys_s)
    print(f"ratio ours/sglang (requests per CPU second): match {s.match_s / o.match_s:.2f} x "
          f"(with key building {both:.2f} x) | insert {s.insert_s / o.insert_s:.2f} x | reuse "
          f"{o.reused / o.prompt_tokens:.1%} vs {s.reused / s.prompt_tokens:.1%} of prompt tokens")


def _report(name: str, t: Times) -> None:
    n = t.n_req
    extra = f" (+ prefix indices {t.extra_s / n * 1e6:.1f} us)" if t.extra_s else ""
    print(f"{name:<7} {n} requests | keys {t.keys_s / n * 1e6:6.1f} us/req | match "
          f"{t.match_s / n * 1e6:6.1f} us ({n / t.match_s:7.0f}/s){extra} | insert "
          f"{t.insert_s / n * 1e6:7.1f} us ({n / t.insert_s:6.0f}/s) | reuse "
          f"{t.reused / t.prompt_tokens:.1%}")


if __name__ == "__main__":  # a part of bench_radix, not a benchmark of its own
    asked = bool({"-h", "--help"} & set(sys.argv[1:]))
    print("bench_radix_sglang is run by bench_radix: PYTHONPATH=. .venv-sglang/bin/python -m "
          "scripts.bench_radix --compare-sglang (see scripts/bench_radix.py --help)",
          file=sys.stdout if asked else sys.stderr)
    raise SystemExit(0 if asked else 2)
