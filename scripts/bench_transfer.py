"""Benchmark KV transfer: a real prefill peer process pushing over NIXL (UCX, loopback).

Reports, for 1, 64 and 1,024 pages per request: bytes/s of KV moved (submit -> "done", so the
ZMQ request, the WRITE and the notification are all inside), descriptors per transfer (pages
contiguous on both sides, and scattered), next to a same-process tensor copy of the same bytes
measured in the same run. Then a multi-turn chat trace (new user messages of 5 to 400 tokens,
half under 100): bytes moved with the decode radix cache under the native protocol (every whole
cached page reused; SWA only where the tree lacks it) and under SGLang's rule, without the cache,
and the
physical minimum (the full KV the decode side lacks plus one SWA window).

The peer is the real `PrefillPeer` over a stand-in runner whose prefill is free (it leaves the
pools as they are), so the numbers are the transfer path only. Geometry: page 16 tokens, 8 KV
heads x 64, bf16 (32 KiB per page per layer), 2 full + 2 sliding layers, window 127.

    python scripts/bench_transfer.py [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from decode_worker.core.pages import PageAllocator
from decode_worker.core.window import sglang_window_start, swa_window_start
from decode_worker.daemon.prefill.peer import PrefillPeer
from decode_worker.daemon.shared.compat import model_compat, region_layouts
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.io.kv.receiver import KVReceiver, TransferEvent
from decode_worker.settings import TransferSettings
from decode_worker.utils.mathx import align_down, cdiv

PS, WINDOW, PAGES = 16, 127, 2200
SPEC = KVSpec(("sliding_attention", "full_attention") * 2, num_kv_heads=8, head_dim=64)


class StandInRunner:
    """Pools plus a free prefill: what `PrefillPeer` needs of a ModelRunner."""

    def __init__(self) -> None:
        self.pools = KVPools(SPEC, PAGES, PAGES, PS, "cpu", torch.bfloat16)
        self.pools.full.normal_()
        self.pools.swa.normal_()
        self.device = torch.device("cpu")
        self.model = SimpleNamespace(cfg=SimpleNamespace(
            layer_types=SPEC.layer_types, num_key_value_heads=8, head_dim=64, window=WINDOW))

    def prefill(self, token_ids: list[int], full: list[int], swa: list[int]) -> torch.Tensor:
        return torch.zeros(16)  # logits: [V] f32


def _peer_main(port: Any, delay_us: int, ready: Any, stop: Any) -> None:
    """The prefill peer on a free port it binds itself; `port.value` is set before `ready`."""
    runner: Any = StandInRunner()
    settings = TransferSettings(bootstrap_port=0, progress_delay_us=delay_us)
    peer = PrefillPeer(runner, settings, "bench")
    port.value = peer.bootstrap_port
    ready.set()
    stop.wait(600)
    peer.close()


class Decode:
    def __init__(self, port: int, delay_us: int) -> None:
        runner: Any = StandInRunner()
        self.pools, self.port = runner.pools, port
        self.aux = AuxBuffer(4)
        self.rx = KVReceiver(TransferSettings(progress_delay_us=delay_us),
                             model_compat(runner, "bench"), region_layouts(runner.pools, self.aux))
        self.full, self.swa = PageAllocator(PAGES, "full"), PageAllocator(PAGES, "swa")
        self.room = 0

    def transfer(self, prompt_len: int, reused: int, s: int, full: list[int], swa: list[int]
                 ) -> TransferEvent:
        self.room += 1
        tid = self.rx.submit("127.0.0.1", self.port, rid=f"b{self.room}", room=self.room,
                             prompt_len=prompt_len, reused_len=reused, swa_window_start=s,
                             full_page_ids=full, swa_page_ids=swa, aux_row=0,
                             prompt_ids=[0] * prompt_len)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for ev in self.rx.take_events():
                if ev.transfer_id == tid and ev.kind != "released":
                    if ev.kind != "done":
                        raise RuntimeError(f"transfer failed: {ev}")
                    return ev
            time.sleep(0.0001)  # a daemon polls between steps; do not starve the peer's cores
        raise RuntimeError("transfer timed out")


def bench_sizes(dec: Decode, reps: int) -> list[dict[str, Any]]:
    rows = []
    for n in (1, 64, 1024):
        for layout in ("contiguous", "scattered"):
            full = list(range(1, n + 1))  # contiguous on both sides (the peer's pools are fresh)
            if layout == "scattered":
                full = [1 + 2 * i for i in torch.randperm(n).tolist()]
            swa = [1]
            L = n * PS
            evs = [dec.transfer(L, 0, L - PS, full, swa) for _ in range(reps)]
            secs = statistics.median(e.duration_s for e in evs)
            nbytes = evs[0].num_bytes
            copy_s = _same_process_copy(nbytes, reps)
            rows.append({"pages": n, "layout": layout, "bytes": nbytes,
                         "descriptors": evs[0].num_descriptors, "transfer_s": secs,
                         "transfer_GBps": nbytes / secs / 1e9, "copy_s": copy_s,
                         "copy_GBps": nbytes / copy_s / 1e9})
    return rows


def _same_process_copy(nbytes: int, reps: int) -> float:
    """Median time of one plain `copy_` of `nbytes` between two host tensors."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16)  # src: [nbytes / 2] bf16
    dst = torch.empty_like(src)  # dst: [nbytes / 2] bf16
    dst.copy_(src)  # first touch of dst's pages is not part of the copy
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chat_messages(seed: int, conversations: int, turns: int) -> list[list[tuple[int, int]]]:
    """Per conversation, (user tokens, answer tokens) per turn: new user messages drawn from 5
    to 400 tokens, half of them under 100 (short replies such as "yes, go on" are where a reuse
    capped at the window start resends the most); answers from 20 to 200 tokens."""
    rng = random.Random(seed)
    return [[(rng.randrange(5, 100) if rng.random() < 0.5 else rng.randrange(100, 401),
              rng.randrange(20, 201)) for _ in range(turns)] for _ in range(conversations)]


def plan_ranges(policy: str, prompt_len: int, cached: int) -> tuple[int, int]:
    """(full KV from, SWA from) that the decode side asks a peer for, per policy; `cached`:
    tokens of this conversation the decode tree holds (its whole pages, with live SWA for the
    last window, as a finished turn leaves them)."""
    L, held = prompt_len, align_down(cached, PS)
    if policy == "native":  # every whole cached page; SWA from the window start, or from P
        s = swa_window_start(L, WINDOW, PS, radix_cache=True)  # when the tree holds it below P
        return held, held if s < held < L else s
    if policy == "sglang":  # SGLang's rule: SWA from max(P, L - window) on its page
        p = held if held > L - WINDOW else min(held, align_down(max(L - WINDOW, 0), PS))
        return p, sglang_window_start(p, L, WINDOW, PS)
    return 0, swa_window_start(L, WINDOW, PS, radix_cache=False)  # no decode radix cache


def chat_trace(dec: Decode, convs: list[list[tuple[int, int]]]) -> dict[str, int]:
    """Moves the real bytes of every turn for each policy and returns the totals next to the
    physical minimum (the full KV the decode side lacks plus one SWA window per turn)."""
    token_bytes = dec.pools.page_bytes("full") // PS
    n_full, n_swa = SPEC.num_full_layers, SPEC.num_swa_layers
    totals = dict.fromkeys(("native", "sglang", "without_cache", "minimum"), 0)
    for conv in convs:
        L = cached = 0
        for user, answer in conv:
            L += user
            for policy in ("native", "sglang", "without_cache"):
                p, s = plan_ranges(policy, L, cached)
                full = dec.full.alloc(cdiv(L, PS) - p // PS)
                swa = dec.swa.alloc(cdiv(L, PS) - s // PS)
                totals[policy] += dec.transfer(L, p, s, full, swa).num_bytes
                dec.full.free(full)
                dec.swa.free(swa)
            totals["minimum"] += (n_full * (L - cached) + n_swa * min(L, WINDOW)) * token_bytes
            L += answer
            cached = L
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--seed", type=int, default=0, help="chat trace seed")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--progress-delay-us", type=int, default=TransferSettings().progress_delay_us,
                    help="transfer.progress_delay_us on both sides (0 = NIXL's busy poll)")
    args = ap.parse_args()
    # One intra-op thread: on a busy host, waking torch's pool for a 128 KiB copy costs a
    # scheduler slice (ms), which would measure the scheduler, not the copy.
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    bound, ready, stop = ctx.Value("i", 0), ctx.Event(), ctx.Event()
    peer = ctx.Process(target=_peer_main, args=(bound, args.progress_delay_us, ready, stop),
                       daemon=True)
    peer.start()
    if not ready.wait(120):
        raise SystemExit("prefill peer did not start")
    try:
        dec = Decode(int(bound.value), args.progress_delay_us)
        sizes = bench_sizes(dec, args.reps)
        trace = chat_trace(dec, chat_messages(args.seed, args.conversations, args.turns))
    finally:
        stop.set()
        peer.join(20)
    print(f"{'pages':>6} {'layout':>10} {'bytes':>11} {'descs':>6} {'ms':>8} {'NIXL GB/s':>10} "
          f"{'copy GB/s':>10}")
    for r in sizes:
        print(f"{r['pages']:>6} {r['layout']:>10} {r['bytes']:>11} {r['descriptors']:>6} "
              f"{1e3 * r['transfer_s']:>8.2f} {r['transfer_GBps']:>10.3f} {r['copy_GBps']:>10.3f}")
    print(f"chat trace ({args.conversations} conversations x {args.turns} turns, user messages "
          f"5-400 tokens, half under 100; seed {args.seed}), bytes moved:")
    for k, v in trace.items():
        print(f"  {k:>14}: {v:>12}  ({v / trace['minimum']:.3f}x minimum, "
              f"{v / trace['without_cache']:.3f}x cache off)")
    print("  sglang = the ranges SGLang's protocol asks for (decode_prefix_len, its SWA window "
          "rule), moved over the native transport")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "chat_trace": trace}, f, indent=2)


if __name__ == "__main__":
    main()
