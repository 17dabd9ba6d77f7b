#!/usr/bin/env python3
"""Speculative decoding on and off on the same requests, in one run: decode tokens per second on
the CPU at batch 1, 8 and 32 through the daemon's stepper and verify step over the built-in
tiny gpt-oss; then spec-sim on a code-editing trace built from a git repository's history
(this one by default).

Each run serves `--waves` x bs requests with at most bs running, a new one joining as one
ends (a server's batch stays full), and counts tokens per second until the last one joined.
Three works:
  repeat   greedy; each prompt was served once before (an agent's repeated call, a retry), so
           the answer repeats one the worker has seen: the repeating work the greedy ratios
           of the last line come from
  loops    greedy, first time: the built-in model's weights are random and its greedy
           answers fall into loops, which prompt lookup predicts (this flatters drafts; the
           spec-sim rows, on real edits, are the honest acceptance figures)
  sampled  temperature 1, first time: drafts mostly fail, and the policy must keep that
           from costing throughput
The ratio of a cell is the median over `--repeats` pairs of runs (off, then on, back to back:
this host's speed drifts by 10 % between runs).

    python scripts/bench_spec.py                     # ~2-3 min on 2 cores
    python scripts/bench_spec.py --batch-sizes 1,8 --max-new 64 --no-trace

The last line is exactly:

    bench_spec: greedy_ratio_bs1=R greedy_ratio_bs8=R greedy_ratio_bs32=R sampled_ratio_min=R
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_worker.core.sampling import SamplingParams
from decode_worker.core.spec.drafter import Drafter, SpecParams, make_drafter
from decode_worker.daemon.decode.speculate import Speculator, StepCost
from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.utils.mathx import cdiv
from tests.spec_rig import Rig

PAGE = 16
ROOT = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-new", type=int, default=96, help="tokens per request")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--waves", type=int, default=4,
                    help="requests per run: this many times the batch size")
    ap.add_argument("--algorithm", default="NGRAM", choices=["NGRAM", "SUFFIX"])
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--repo", type=Path, default=ROOT, help="git repository for the trace")
    ap.add_argument("--trace-records", type=int, default=60)
    ap.add_argument("--no-trace", action="store_true", help="skip the spec-sim part")
    ap.add_argument("--repeats", type=int, default=5,
                    help="pairs of runs (off, on) per cell; the ratio is the pairs' median")
    return ap.parse_args(argv)


WORKS = ("repeat", "loops", "sampled")


def prompts_of(work: str, n: int, prompt_len: int) -> list[list[int]]:
    """`n` prompts of the work: a phrase said again and again then a request's own words
    (greedy works), or random tokens (sampled)."""
    gen = torch.Generator().manual_seed(n)
    out = []
    for _ in range(n):
        phrase = torch.randint(3, 200, (8,), generator=gen).tolist()
        tail = torch.randint(3, 200, (prompt_len // 4,), generator=gen).tolist()
        out.append(torch.randint(3, 200, (prompt_len,), generator=gen).tolist()
                   if work == "sampled" else phrase * (prompt_len // 8) + tail)
    return out


def serve(rig: Rig, prompts: list[list[int]], params: SamplingParams, bs: int,
          prefix: str) -> tuple[dict[str, list[int]], float]:
    """Serve `prompts` with at most `bs` running at once, a new one joining as soon as one
    ends, as a server's batch stays full; each request's output tokens and the tokens per
    second while the batch was full (from the start until the last prompt joined: after
    that the batch drains, and the requests that speculation sped up end first, timing a
    tail at a smaller batch that a server, with more requests coming, does not have)."""
    waiting = list(enumerate(prompts))
    t0, done0 = time.perf_counter(), rig.stepper.generated_tokens_total
    rate = 0.0
    while waiting or rig.table.lives or rig.stepper.busy:
        while waiting and len(rig.table.lives) < bs:
            i, prompt = waiting.pop(0)
            rig.add(f"{prefix}{i}", prompt, None, params)
            if not waiting:
                rate = ((rig.stepper.generated_tokens_total - done0)
                        / (time.perf_counter() - t0))
        rig.stepper.step(0.0)
        rig.table.poll(0.0)
        rig.readmit()
    return rig.run(), rate


def tokens_per_s(model, bs: int, args: argparse.Namespace, work: str,  # type: ignore[no-untyped-def]
                 spec: bool, drafter: Drafter | None = None,
                 outputs: dict[str, list[int]] | None = None) -> tuple[float, str]:
    """Decode tokens per second of `bs` requests of `work` to the end, and the spec counts.
    `repeat`: each prompt was served once before (not timed; both sides serve it), so its
    greedy answer repeats one the worker has seen (an agent's repeated call, a retry).
    `drafter`: drafts from it instead of `--algorithm`'s; `outputs` gets each request's
    output tokens."""
    k = args.num_draft_tokens
    pages = (bs + 1) * (cdiv(args.prompt_len + args.max_new + k, PAGE) + 2) + 8
    pools = KVPools(KVSpec.from_config(model.cfg), pages, pages, PAGE, "cpu", torch.float32)
    runner = ModelRunner(model, pools, use_cuda_graph=False, graph_batch_sizes=[1],
                         lookahead=k)
    speculator = None
    if spec:
        counts = sorted({1 << i for i in range((bs * (1 + k)).bit_length())} | {bs * (1 + k)})
        ctx = args.prompt_len + args.max_new // 2
        cost = StepCost(runner.step_seconds(counts, ctx),
                        runner.step_seconds(counts, ctx, group=1 + k))
        speculator = Speculator(drafter or make_drafter(SpecParams(args.algorithm, k)), k, cost)
    rig = Rig(runner, spec=speculator, page_size=PAGE, window=model.cfg.window, num_rows=bs,
              full_pages=pages, swa_pages=pages)
    # every request runs to max_new_tokens on both sides (a sampled EOS would make the work
    # differ between the runs)
    params = SamplingParams(max_new_tokens=args.max_new,
                            temperature=1.0 if work == "sampled" else 0, ignore_eos=True)
    prompts = prompts_of(work, bs * args.waves, args.prompt_len)
    if work == "repeat":
        serve(rig, prompts, params, bs, "first")
    st = speculator.stats if speculator is not None else None
    before = (st.verify_steps_total, st.proposed_total, st.accepted_total) if st else (0, 0, 0)
    out, rate = serve(rig, prompts, params, bs, "r")
    if outputs is not None:
        outputs.update(out)
    note = ""
    if st is not None:
        verifies, proposed, accepted = (st.verify_steps_total - before[0],
                                        st.proposed_total - before[1],
                                        st.accepted_total - before[2])
        acc = accepted / proposed if proposed else 0.0
        note = f"verifies {verifies}, proposed {proposed}, accepted {accepted} ({acc:.0%})"
    return rate, note


def bench_cpu(args: argparse.Namespace) -> dict[str, float]:
    model_dir = write_model(Path(tempfile.mkdtemp(prefix="bench-spec-")) / "tiny", seed=0)
    model = load_model(model_dir, "cpu", torch.float32)
    tokens_per_s(model, 2, argparse.Namespace(**{**vars(args), "max_new": 8}), "loops", False)
    print(f"CPU, built-in tiny gpt-oss, {args.algorithm} K={args.num_draft_tokens}, prompt "
          f"{args.prompt_len}, {args.max_new} new tokens per request, {args.waves} x bs "
          "requests per run, at most bs at once (tok/s while the batch is full)")
    print(f"tok/s: medians of {args.repeats} runs per side; ratio: the median of the (off, "
          "on) pairs, each run back to back")
    print("  repeat : greedy, each prompt served once before (an agent's repeated call, a "
          "retry): the answer repeats one the worker has seen")
    print("  loops  : greedy, first time: the built-in model's weights are random and its "
          "greedy answers fall into loops, which prompt lookup predicts (flatters drafts)")
    print("  sampled: temperature 1, first time: drafts mostly fail")
    print(f"{'work':<8} {'bs':>3} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6}  spec")
    ratios: dict[str, float] = {}
    for work in WORKS:
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            offs, ons, note = [], [], ""
            for _ in range(args.repeats):  # alternate: this host's speed drifts
                offs.append(tokens_per_s(model, bs, args, work, False)[0])
                on_rate, note = tokens_per_s(model, bs, args, work, True)
                ons.append(on_rate)
            # the median of each pair's ratio: a pair runs back to back, so a slow spell of
            # the host hits both sides of it
            ratio = statistics.median(on / off for on, off in zip(ons, offs, strict=True))
            ratios[f"{work}_bs{bs}"] = ratio
            print(f"{work:<8} {bs:>3} {statistics.median(offs):>10.1f} "
                  f"{statistics.median(ons):>10.1f} {ratio:>6.2f}  {note}", flush=True)
    return ratios


def bench_trace(args: argparse.Namespace) -> None:
    trace = Path(tempfile.mkdtemp(prefix="bench-spec-trace-")) / "trace.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "spec_trace_from_git.py"),
                    str(args.repo), "--out", str(trace), "--max-records",
                    str(args.trace_records)], check=True, stdout=subprocess.DEVNULL)
    print(f"\nspec-sim on {args.trace_records} real edits of {args.repo} (o200k tokens):")
    for algo, extra in (("NGRAM", []), ("SUFFIX", []),
                        ("SUFFIX", ["--speculative-suffix-max-spec-factor", "2"])):
        out = subprocess.run(
            [sys.executable, "-m", "decode_worker", "spec-sim", str(trace),
             "--speculative-algorithm", algo, "--speculative-num-draft-tokens",
             str(args.num_draft_tokens), *extra],
            check=True, capture_output=True, text=True, cwd=ROOT).stdout.strip().splitlines()
        print(f"  {algo:<6} {' '.join(extra):<40} {out[-1]}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ratios = bench_cpu(args)
    if not args.no_trace:
        bench_trace(args)
    print("\nGPU (verify cost against the decode step, batch 1-128 x k 1-8, gpt-oss-20b shape): "
          "not measured (no GPU in this run; scripts/gpu_check.sh on a lent device)")
    sampled = [v for k, v in ratios.items() if k.startswith("sampled")]
    greedy = {k: v for k, v in ratios.items() if k.startswith("repeat")}
    print("greedy ratios below: the repeat rows")
    print("bench_spec: " + " ".join(f"{k.replace('repeat_', 'greedy_ratio_')}={v:.2f}"
                     for k, v in greedy.items())
          + f" sampled_ratio_min={min(sampled) if sampled else 0.0:.2f}")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        raise SystemExit(main())
