#!/usr/bin/env python3
"""Verify steps on a GPU: what `1 + k` queries per request cost against one (docs/GPU.md,
"Verify steps"), at gpt-oss-20b's shape, batch x k x context cells.

    attention  one full and one sliding layer's decode attention (KV write + kernels), no graph:
               a plain step (bs entries), a verify step through the grouped kernel (bs (1 + k)
               entries, each request's keys read once) and the same entries through the
               single-query kernel (keys read 1 + k times): CUDA-event median of --iters
    step       the daemon's `decode_rows` with CUDA graphs over the whole model (MXFP4 experts):
               a plain step against a verify step of the same requests (drafts of k tokens),
               model + argmax; a verify step pays when it commits more than `verify / plain`
               tokens a request
    graphs     what the daemon captures at start-up with speculation on (K = 8, the default
               graph batch sizes, contexts to --step-context): graph count, how many are
               verify graphs, capture seconds

    python scripts/bench_gpu_verify.py [--parts attention,step] [--batch-sizes 1,8,32,64,128]
        [--ks 1,2,4,8] [--contexts 1024,8192,32768] [--step-context 4096]

CUDA only: without a device it says so and exits 0. Last line:
`bench_gpu_verify: attn_grouped_bs64_k4_8k=<x> attn_per_entry_bs64_k4_8k=<x>
step_bs64_k4=<x> worst_step=<x> graphs=<n> verify_graphs=<n> capture_s=<s>` (ratios to the
plain step; nan where not run).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python scripts/...` too

from decode_worker.device.decode_inputs import swa_ring_width
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.query_groups import QueryGroups, group_starts
from decode_worker.device.runner import ModelRunner
from decode_worker.settings.sections import SchedulerSettings
from decode_worker.utils.mathx import cdiv
from scripts.bench_gpu_decode import load
from scripts.gpu_floor import shape_config

K_MAX = 8  # the most drafts a cell verifies (the SWA ring and the tables leave room for them)


def timed_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median ms of `fn` after one warm-up (CUDA events; wall time elsewhere)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def entries(bs: int, k: int, ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """(request index, position) of each entry: request i at ctx - 1 .. ctx - 1 + k."""
    req = np.repeat(np.arange(bs), 1 + k)  # [bs (1 + k)]
    pos = ctx - 1 + np.tile(np.arange(1 + k), bs)  # [bs (1 + k)]
    return req, pos


def attention_ms(pools: KVPools, tables: tuple[torch.Tensor, torch.Tensor], heads: int,
                 window: int, bs: int, k: int, ctx: int, grouped: bool, iters: int) -> float:
    """One full + one sliding layer for `bs` requests with `k` drafts each at context `ctx`
    (`grouped`: the verify kernel, else every entry through the single-query kernel)."""
    from decode_worker.device.attention_triton import TritonDecodeAttention

    dev, spec = pools.full.device, pools.spec
    req, pos = entries(bs, k, ctx)
    req_t = torch.from_numpy(req).to(dev)  # [n]
    groups = (QueryGroups(torch.from_numpy(group_starts(req, pos)).to(dev), 1 + k)
              if grouped and k else None)
    attn = TritonDecodeAttention(pools, window, torch.from_numpy(pos).to(dev),
                                 tables[0][req_t], tables[1][req_t], ctx + K_MAX, groups=groups)
    n, kvh, hd = len(req), spec.num_kv_heads, spec.head_dim
    q = torch.randn(n, heads, hd, device=dev, dtype=pools.dtype)  # [n, heads, hd]
    new = torch.randn(n, kvh, hd, device=dev, dtype=pools.dtype)  # [n, kvh, hd]: K and V
    sinks = torch.zeros(heads, device=dev)  # [heads]
    return timed_ms(lambda: [attn(layer, q, new, new, sinks) for layer in (0, 1)], iters, dev)


def attention_pools(kv_heads: int, head_dim: int, window: int, page: int, bs: int, ctx: int,
                    device: torch.device) -> tuple[KVPools, tuple[torch.Tensor, torch.Tensor]]:
    """Random pools of one full and one sliding layer for `bs` requests of `ctx + K_MAX`
    tokens, each on its own pages: (pools, (full table [bs, W], swa ring [bs, R]))."""
    need, ring = cdiv(ctx + K_MAX, page), swa_ring_width(window + K_MAX, page)
    spec = KVSpec(("full_attention", "sliding_attention"), kv_heads, head_dim)
    pools = KVPools(spec, bs * need, bs * ring, page, device, torch.bfloat16)
    pools.full.normal_()
    pools.swa.normal_()
    full = 1 + torch.arange(bs * need, device=device, dtype=torch.int32).view(bs, need)
    swa = 1 + torch.arange(bs * ring, device=device, dtype=torch.int32).view(bs, ring)
    return pools, (full, swa)


def attention_table(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Print one row per (ctx, bs, k); return the contract's attention ratios."""
    cfg = shape_config("20b")
    kvh, hd, window = cfg.num_key_value_heads, cfg.head_dim, cfg.window
    print("| ctx | bs | k | plain ms | verify grouped ms | verify per-entry ms | grouped / plain"
          " | per-entry / plain |\n|---|---|---|---|---|---|---|---|")
    out = {}
    for ctx in args.contexts:
        for bs in args.batch_sizes:
            pools, tables = attention_pools(kvh, hd, window, args.page_size, bs, ctx, device)
            cell = (pools, tables, cfg.num_attention_heads, window, bs)
            plain = attention_ms(*cell, 0, ctx, False, args.iters)
            for k in args.ks:
                grouped = attention_ms(*cell, k, ctx, True, args.iters)
                per_entry = attention_ms(*cell, k, ctx, False, args.iters)
                print(f"| {ctx} | {bs} | {k} | {plain:.3f} | {grouped:.3f} | {per_entry:.3f} | "
                      f"{grouped / plain:.2f} | {per_entry / plain:.2f} |", flush=True)
                if (ctx, bs, k) == (8192, 64, 4):
                    out = {"grouped": grouped / plain, "per_entry": per_entry / plain}
            del pools, tables, cell
            torch.cuda.empty_cache()
    return out


def step_ms(model: GptOssModel, pools: KVPools, bs: int, k: int, ctx: int, iters: int) -> float:
    """The daemon's decode_rows (graphs) for `bs` requests at `ctx`, k drafts each (0: plain),
    request i on pages [1 + i * need, ...) of `pools`; model + argmax."""
    cfg, page = model.cfg, pools.page_size
    need, ring = cdiv(ctx + K_MAX, page), swa_ring_width(cfg.window + K_MAX, page)
    req, pos = entries(bs, k, ctx)
    runner = ModelRunner(model, pools, use_cuda_graph=True, graph_batch_sizes=[len(req)],
                         max_graph_pages=need, attention_backend="auto", lookahead=K_MAX)
    inputs = runner.new_inputs(bs)
    rows = [inputs.acquire() for _ in range(bs)]
    for i, row in enumerate(rows):
        inputs.write_full(row, 0, list(range(1 + i * need, 1 + (i + 1) * need)))
        inputs.write_swa(row, 0, [1 + i * ring + c % ring for c in range(need)])
        inputs.write_token(row, (7919 * i) % cfg.vocab_size)
    row_a = np.asarray(rows, np.int64)[req]  # [n]
    idx = np.flatnonzero(pos != ctx - 1)  # the draft entries
    drafts = (idx, (idx * 31) % cfg.vocab_size) if k else None
    try:
        return timed_ms(lambda: runner.decode_rows(inputs, row_a, pos, drafts)[0].argmax(-1),
                        iters, model.device)
    finally:
        runner.destroy()


def step_table(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Load gpt-oss-20b's shape (MXFP4 experts), print one row per (bs, k); return ratios."""
    model, ctx, page = load(args, device), args.step_context, args.page_size
    cfg, out = model.cfg, {}
    print("| ctx | bs | k | plain step ms | verify step ms | verify / plain |\n"
          "|---|---|---|---|---|---|")
    for bs in args.batch_sizes:
        need, ring = cdiv(ctx + K_MAX, page), swa_ring_width(cfg.window + K_MAX, page)
        pools = KVPools(KVSpec.from_config(cfg), bs * need, bs * ring, page, device,
                        torch.bfloat16)
        pools.full.normal_()
        pools.swa.normal_()
        plain = step_ms(model, pools, bs, 0, ctx, args.iters)
        for k in args.ks:
            ms = step_ms(model, pools, bs, k, ctx, args.iters)
            out[f"step_bs{bs}_k{k}"] = ms / plain
            print(f"| {ctx} | {bs} | {k} | {plain:.2f} | {ms:.2f} | {ms / plain:.2f} |",
                  flush=True)
        del pools
        torch.cuda.empty_cache()
    return out


def graph_capture(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Start-up capture as the daemon does it with speculation on (K = K_MAX): every default
    size bucket, plain and grouped graphs."""
    model, ctx, page = load(args, device), args.step_context, args.page_size
    cfg = model.cfg
    need, ring = cdiv(ctx + K_MAX, page), swa_ring_width(cfg.window + K_MAX, page)
    pools = KVPools(KVSpec.from_config(cfg), 2 * need, 2 * ring, page, device, torch.bfloat16)
    sizes = SchedulerSettings().cuda_graph_batch_sizes
    runner = ModelRunner(model, pools, use_cuda_graph=True, graph_batch_sizes=sizes,
                         max_graph_pages=need, attention_backend="auto", lookahead=K_MAX)
    try:
        t0 = time.perf_counter()
        count = runner.capture_graphs(ctx, tuple(range(2, K_MAX + 2)))
        took = time.perf_counter() - t0
        grouped = len(runner.graphs.grouped) if runner.graphs is not None else 0
    finally:
        runner.destroy()
    print(f"start-up capture, K={K_MAX}, sizes {sizes}, contexts to {ctx}: {count} graphs "
          f"({grouped} for verify steps) in {took:.1f} s", flush=True)
    return {"graphs": count, "verify_graphs": grouped, "capture_s": took}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    p.add_argument("--parts", default="attention,step,graphs")
    p.add_argument("--batch-sizes", type=ints, default=ints("1,8,32,64,128"))
    p.add_argument("--ks", type=ints, default=ints("1,2,4,8"))
    p.add_argument("--contexts", type=ints, default=ints("1024,8192,32768"),
                   help="attention part")
    p.add_argument("--step-context", type=int, default=4096, help="step part")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--page-size", type=int, default=64)
    args = p.parse_args()
    args.shape, args.moe_backend = "20b", "auto"  # what bench_gpu_decode.load reads
    return args


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        print("bench_gpu_verify: needs CUDA (no CUDA device is visible); nothing measured")
        return 0
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device))
    with torch.inference_mode():
        attn = attention_table(args, device) if "attention" in args.parts else {}
        steps = step_table(args, device) if "step" in args.parts else {}
        graphs = graph_capture(args, device) if "graphs" in args.parts else {}
    nan = math.nan
    print(f"bench_gpu_verify: attn_grouped_bs64_k4_8k={attn.get('grouped', nan):.2f} "
          f"attn_per_entry_bs64_k4_8k={attn.get('per_entry', nan):.2f} "
          f"step_bs64_k4={steps.get('step_bs64_k4', nan):.2f} "
          f"worst_step={max(steps.values(), default=nan):.2f} "
          f"graphs={graphs.get('graphs', nan):.0f} "
          f"verify_graphs={graphs.get('verify_graphs', nan):.0f} "
          f"capture_s={graphs.get('capture_s', nan):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
