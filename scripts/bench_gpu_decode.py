#!/usr/bin/env python3
"""The daemon's decode step on a GPU at gpt-oss's real shape, next to its memory-bandwidth floor.

Builds gpt-oss-20b's shape (or 120b's, `--shape 120b`) with random weights as an MXFP4 checkpoint
in device memory, loads it through the product's loader (`weights.from_state_dict`, MoE backend
per `--moe-backend`), fills the KV pools with random values and times one decode step (the
`decode_rows` path with CUDA graphs: model + argmax + token write-back; median of `--steps`
after warm-up) at every batch x context cell whose pools fit. The floor of a cell is the bytes
the step must read (docs/GPU.md, "Floor": attention and lm_head weights, the
experts a batch hits, the KV it attends to) over the device-to-device copy bandwidth measured
first. CUDA only: without a device it says so and exits 0.

    python scripts/bench_gpu_decode.py [--shape 120b] [--batch-sizes 1,8] [--contexts 1024]

Last line: `bench_gpu_decode: bs1_1k_ms=<ms> bs64_8k_ms=<ms> worst_floor_ratio=<x>
weights_gib=<GiB>` (the ratio against the MXFP4 floor, over every cell; nan where not run).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python scripts/...` too

from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.config import GptOssConfig
from decode_worker.device.model.gpt_oss import GptOssModel
from decode_worker.device.model.synthetic import random_mxfp4_checkpoint
from decode_worker.device.model.weights import from_state_dict, resolve_moe_backend
from decode_worker.device.runner import ModelRunner
from decode_worker.utils.mathx import cdiv
from scripts.gpu_floor import (
    GIB,
    SHAPES,
    floor_ms,
    shape_config,
    step_bytes,
)


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 2 * GIB, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, read + write bytes, median of `iters` copies."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)  # [n] u8
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / statistics.median(times) / 1e9


def make_runner(model: GptOssModel, pools: KVPools, batch: int, pages: int,
                attention: str) -> ModelRunner:
    """The daemon's runner over `pools`, CUDA graphs for one batch bucket up to `pages` wide."""
    return ModelRunner(model, pools, use_cuda_graph=True, graph_batch_sizes=[batch],
                       max_graph_pages=pages, attention_backend=attention)


def request_bytes(cfg: GptOssConfig, pools_dtype: torch.dtype, page_size: int,
                  context: int) -> int:
    """Pool bytes one request at `context` tokens holds (full pages + its SWA ring)."""
    spec = KVSpec.from_config(cfg)
    ring = cdiv(cfg.window, page_size) + 1
    return spec.page_bytes(page_size, pools_dtype) * (
        cdiv(context, page_size) * spec.num_full_layers + ring * spec.num_swa_layers)


def random_pools(cfg: GptOssConfig, batch: int, context: int, page_size: int,
                 device: torch.device) -> KVPools:
    """Pools for `batch` requests of `context` tokens, every value random (never zeros)."""
    ring = cdiv(cfg.window, page_size) + 1
    pools = KVPools(KVSpec.from_config(cfg), batch * cdiv(context, page_size), batch * ring,
                    page_size, device, torch.bfloat16)
    pools.full.normal_()
    pools.swa.normal_()
    return pools


def time_cell(model: GptOssModel, pools: KVPools, batch: int, context: int,
              args: argparse.Namespace) -> float:
    """Median ms of one decode step for `batch` requests at position `context - 1`."""
    ps, cfg = pools.page_size, model.cfg
    need, ring = cdiv(context, ps), cdiv(cfg.window, ps) + 1
    runner = make_runner(model, pools, batch, need, args.attention_backend)
    slots = runner.new_inputs(batch)
    last = (context - 1) // ps
    ids = []
    for i in range(batch):
        ids.append(slots.acquire())
        slots.write_full(ids[-1], 0, list(range(1 + i * need, 1 + (i + 1) * need)))
        first = max(0, last - ring + 1)
        slots.write_swa(ids[-1], first, list(range(1 + i * ring, 1 + i * ring + last - first + 1)))
        slots.write_token(ids[-1], (7919 * i) % cfg.vocab_size)
    positions = [context - 1] * batch
    times = []
    try:
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits, slots_t = runner.decode_rows(slots, ids, positions)
            slots.tokens[slots_t] = logits.argmax(-1)  # [bs]
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
    finally:
        runner.destroy()
    return statistics.median(times) * 1e3


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="20b")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="1024,8192,32768")
    p.add_argument("--steps", type=int, default=10, help="timed steps per cell (>= 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--moe-backend", choices=["auto", "triton", "torch"], default="auto",
                   help="model.moe_backend (torch: MXFP4 dequantized to bf16 at load)")
    p.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto",
                   help="model.attention_backend")
    p.add_argument("--headroom-gib", type=float, default=8.0,
                   help="device memory left free for activations and graphs")
    args = p.parse_args()
    args.steps = max(args.steps, 10)
    return args


def load(args: argparse.Namespace, device: torch.device) -> GptOssModel:
    cfg = shape_config(args.shape)
    backend = resolve_moe_backend(args.moe_backend, device)
    t0 = time.perf_counter()
    state = random_mxfp4_checkpoint(cfg, device, torch.bfloat16, seed=0)
    built = time.perf_counter()
    model = from_state_dict(cfg, state, device, torch.bfloat16, moe_backend=backend)
    del state
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(f"shape {args.shape}: built the MXFP4 checkpoint in {built - t0:.1f} s, loaded in "
          f"{time.perf_counter() - built:.1f} s (MoE {backend}), weights "
          f"{model.weights_bytes() / GIB:.2f} GiB, allocated "
          f"{torch.cuda.memory_allocated(device) / GIB:.2f} GiB")
    return model


def run(args: argparse.Namespace, model: GptOssModel, bandwidth: float,
        device: torch.device) -> dict[tuple[int, int], float]:
    """Time every cell that fits; print a table row per cell; return {(bs, ctx): ms}."""
    cfg, results = model.cfg, {}
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print("| bs | ctx | graph ms | tok/s | floor bf16 ms | floor MXFP4 ms | graph / MXFP4 floor |")
    print("|---|---|---|---|---|---|---|")
    for ctx in [int(c) for c in args.contexts.split(",")]:
        free = torch.cuda.mem_get_info(device)[0] - args.headroom_gib * GIB
        fit = [b for b in sizes if b * request_bytes(cfg, torch.bfloat16, args.page_size, ctx)
               <= free]
        if len(fit) < len(sizes):
            print(f"(ctx {ctx}: batches {[b for b in sizes if b not in fit]} do not fit)")
        if not fit:
            continue
        pools = random_pools(cfg, max(fit), ctx, args.page_size, device)
        for bs in fit:
            try:
                ms = time_cell(model, pools, bs, ctx, args)
            except torch.cuda.OutOfMemoryError:  # the step's temporaries, not the pools
                print(f"| {bs} | {ctx} | out of memory | | | | |", flush=True)
                torch.cuda.empty_cache()
                continue
            results[(bs, ctx)] = ms
            bf16 = floor_ms(step_bytes(cfg, bs, ctx, mxfp4=False), bandwidth)
            mx = floor_ms(step_bytes(cfg, bs, ctx, mxfp4=True), bandwidth)
            print(f"| {bs} | {ctx} | {ms:.2f} | {bs / ms * 1e3:.0f} | {bf16:.2f} | {mx:.2f} "
                  f"| {ms / mx:.1f}x |", flush=True)
        del pools
        torch.cuda.empty_cache()
    return results


def summary(results: dict[tuple[int, int], float], cfg: GptOssConfig, bandwidth: float,
            weights_gib: float) -> str:
    """The contract's last line (nan for a cell that did not run)."""
    worst = max((ms / floor_ms(step_bytes(cfg, bs, ctx, mxfp4=True), bandwidth)
                 for (bs, ctx), ms in results.items()), default=math.nan)
    return (f"bench_gpu_decode: bs1_1k_ms={results.get((1, 1024), math.nan):.2f} "
            f"bs64_8k_ms={results.get((64, 8192), math.nan):.2f} "
            f"worst_floor_ratio={worst:.2f} weights_gib={weights_gib:.2f}")


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        print("bench_gpu_decode: needs CUDA (no CUDA device is visible); nothing measured")
        return 0
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth_gbps(device)
    print(f"{torch.cuda.get_device_name(device)}: device-to-device copy {bandwidth:.0f} GB/s "
          f"(read + write)")
    with torch.inference_mode():
        model = load(args, device)
        results = run(args, model, bandwidth, device)
    print(summary(results, model.cfg, bandwidth, model.weights_bytes() / GIB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
