#!/usr/bin/env python3
"""Speculation's "never slower" policy over a grid: decode tokens per second with speculation on
against off, at batch 1 .. 128 x the share of draft tokens that are right, 0 .. 100 %, on the
CPU with the built-in tiny gpt-oss (greedy; the daemon's stepper, verify step and policy).

The drafts come from a drafter that knows each request's answer (a run without speculation
first): each draft token is the right one with probability p, independently, so a verify
keeps a run of right tokens up to the first wrong one. The policy does not know p; it has to
find it from what verifies and declined drafts show. A cell is the median ratio of
`--repeats` (off, on) pairs run back to back (this host's speed drifts between runs).

    python scripts/bench_spec_policy.py                  # ~2-3 min on 2 cores
    python scripts/bench_spec_policy.py --batch-sizes 1,8 --accept 0,1

The last line is exactly:

    bench_spec_policy: worst_ratio=R at_bs=B at_accept=P
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_worker.device.default_model import write_model
from decode_worker.device.model.weights import load_model
from scripts import bench_spec
from tests.spec_rig import ScriptedDrafter


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64,128")
    ap.add_argument("--accept", default="0,0.25,0.5,0.75,1",
                    help="shares of draft tokens that are right")
    ap.add_argument("--max-new", type=int, default=48, help="tokens per request")
    ap.add_argument("--waves", type=int, default=2,
                    help="requests per run: this many times the batch size")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="(off, on) pairs per cell")
    args = ap.parse_args(argv)
    args.prompt_len, args.algorithm = 64, "NGRAM"  # what bench_spec.tokens_per_s reads
    return args


def oracle(sequences: dict[str, list[int]], p: float, vocab: int) -> ScriptedDrafter:
    """Drafts of each request's known sequence (prompt and answer), each token right with
    probability p (a wrong one is another token); the same request and position always draft
    the same."""

    def draft(rid: str, toks: list[int], k: int) -> list[int]:
        known, at = sequences[rid], len(toks)
        rng = random.Random(hash((rid, at)))
        return [t if rng.random() < p else (t + 1) % vocab for t in known[at:at + k]]

    return ScriptedDrafter(draft)


def cell(model, bs: int, p: float, args: argparse.Namespace,  # type: ignore[no-untyped-def]
         answers: dict[str, list[int]]) -> tuple[float, str]:
    """The median on/off ratio at batch `bs`, drafts right with probability p."""
    ratios, note = [], ""
    for _ in range(args.repeats):
        off, _ = bench_spec.tokens_per_s(model, bs, args, "loops", False)
        drafter = oracle(answers, p, model.cfg.vocab_size)
        on, note = bench_spec.tokens_per_s(model, bs, args, "loops", True, drafter)
        ratios.append(on / off)
    return statistics.median(ratios), note


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model = load_model(write_model(Path(tempfile.mkdtemp(prefix="bench-policy-")) / "tiny",
                                   seed=0), "cpu", torch.float32)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    shares = [float(a) for a in args.accept.split(",")]
    print(f"CPU, built-in tiny gpt-oss, greedy, K={args.num_draft_tokens}, "
          f"{args.waves} x bs requests of {args.max_new} tokens, at most bs at once; speculation "
          "on / off tokens per second (median of the pairs)")
    print("| bs | " + " | ".join(f"right {a:.0%}" for a in shares) + " |")
    print("|---|" + "---|" * len(shares))
    worst = (float("inf"), 0, 0.0)
    for bs in sizes:
        outputs: dict[str, list[int]] = {}
        bench_spec.tokens_per_s(model, bs, args, "loops", False, outputs=outputs)
        prompts = bench_spec.prompts_of("loops", bs * args.waves, args.prompt_len)
        answers = {f"r{i}": prompt + outputs[f"r{i}"] for i, prompt in enumerate(prompts)}
        row = []
        for p in shares:
            ratio, _ = cell(model, bs, p, args, answers)
            row.append(ratio)
            worst = min(worst, (ratio, bs, p))
        print(f"| {bs} | " + " | ".join(f"{r:.2f}" for r in row) + " |", flush=True)
    print(f"bench_spec_policy: worst_ratio={worst[0]:.2f} at_bs={worst[1]} "
          f"at_accept={worst[2]:g}")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        raise SystemExit(main())
