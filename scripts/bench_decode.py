#!/usr/bin/env python3
"""Decode throughput of the paged runtime next to transformers' `generate`, same weights, same run.

For each batch size: prefill `--prompt-len` random tokens per request, then time `--steps`
batched decode steps (per-step latency median / p90, tokens/s) through the daemon's path
(persistent decode inputs, `ModelRunner.decode_rows`). The
reference is `GptOssForCausalLM.generate` (greedy) on the same directory, timed as
(time(steps new tokens) - time(1 new token)) / (steps - 1) per step, so its prefill cancels out.
On CUDA the runtime is measured with CUDA graphs and eager. Greedy tokens of both are compared.

    python scripts/bench_decode.py                       # tiny default model, CPU, ~1 min
    python scripts/bench_decode.py --model DIR --device cuda --batch-sizes 1,8,32,64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from decode_worker.device.default_model import write_model
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.weights import load_model
from decode_worker.device.runner import ModelRunner
from decode_worker.utils.mathx import cdiv


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="HF gpt-oss dir (default: the tiny default model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Rows:
    """Requests decoding through the daemon's path: persistent page-table rows, next tokens
    written on the device by the argmax (`decode_rows`), only new pages written per step."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], steps: int) -> None:
        ps = runner.pools.page_size
        self.runner, self.inputs = runner, runner.new_inputs(len(prompts))
        self.ids: list[int] = []
        self.seqs: list[list[int]] = []
        self.tables: list[list[int]] = []
        nxt = 1
        for prompt in prompts:
            pages = list(range(nxt, nxt + cdiv(len(prompt) + steps, ps)))
            nxt += len(pages)
            self.seqs.append([*prompt, int(runner.prefill(prompt, pages, pages).argmax())])
            self.ids.append(self.inputs.acquire())
            self.tables.append(pages)
            self.inputs.write_full(self.ids[-1], 0, pages)
            self.inputs.write_swa(self.ids[-1], 0, pages[:len(prompt) // ps + 1])
            self.inputs.write_token(self.ids[-1], self.seqs[-1][-1])

    def step(self) -> list[int]:
        """One greedy step of every request; its tokens (appended to `seqs`)."""
        ps, inputs = self.runner.pools.page_size, self.inputs
        positions = [len(s) - 1 for s in self.seqs]
        for row, pages, pos in zip(self.ids, self.tables, positions, strict=True):
            if pos % ps == 0:  # the page the core just added
                inputs.write_swa(row, pos // ps, [pages[pos // ps]])
        logits, rows_t = self.runner.decode_rows(inputs, self.ids, positions)
        chosen = logits.argmax(-1)  # [bs]
        inputs.tokens[rows_t] = chosen
        tokens = self.runner.fetch_tokens(chosen).wait()
        for s, t in zip(self.seqs, tokens, strict=True):
            s.append(t)
        return tokens


def bench_runtime(runner: ModelRunner, prompts: list[list[int]], steps: int
                  ) -> tuple[list[float], list[list[int]]]:
    """Per-step seconds and the greedy tokens (first from prefill, then `steps - 1` decodes)."""
    rows, dev = Rows(runner, prompts, steps), runner.device
    times = []
    for _ in range(steps - 1):
        sync(dev)
        t0 = time.perf_counter()
        rows.step()
        times.append(time.perf_counter() - t0)
    return times, [s[len(p):] for s, p in zip(rows.seqs, prompts, strict=True)]


def bench_reference(ref, prompts: list[list[int]], steps: int  # type: ignore[no-untyped-def]
                    ) -> tuple[float, list[list[int]]]:
    """Seconds per decode step of `generate` (median of 3) and its greedy tokens."""
    ids = torch.tensor(prompts, device=ref.device)
    kw = {"do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}

    def timed(n: int) -> tuple[float, torch.Tensor]:
        sync(ref.device)
        t0 = time.perf_counter()
        out = ref.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(ref.device)
        return time.perf_counter() - t0, out

    timed(2)  # warm-up
    per_step = []
    for _ in range(3):  # the median of 3 pairs damps noise from other processes
        t1, _ = timed(1)
        tn, out = timed(steps)
        per_step.append((tn - t1) / (steps - 1))
    return statistics.median(per_step), out[:, ids.shape[1]:].tolist()


def bench_paired(runner: ModelRunner, ref, prompts: list[list[int]],  # type: ignore[no-untyped-def]
                 steps: int) -> tuple[list[float], list[float], list[list[int]], list[list[int]]]:
    """Steps of the runtime and of the reference's cached forward (`model(next, cache=...)`,
    what `generate` runs per step, with the same explicit position ids) timed alternately, so
    load from other processes hits both alike. Each side feeds back its own greedy tokens.
    Returns (our step times, reference step times, our tokens, the reference's tokens)."""
    from transformers import DynamicCache

    dev = runner.device
    rows = Rows(runner, prompts, steps)
    ours = [s[-1] for s in rows.seqs]
    bs, length = len(prompts), len(prompts[0])
    cache = DynamicCache(config=ref.config)
    pos = torch.arange(length, device=dev)[None].expand(bs, -1)  # [bs, L], as generate passes
    out = ref(input_ids=torch.tensor(prompts, device=dev), position_ids=pos, cache=cache,
              use_cache=True)
    theirs = out.logits[:, -1].argmax(-1)  # [bs]
    ours_seq, theirs_seq = [[t] for t in ours], [[t] for t in theirs.tolist()]
    ours_t, ref_t = [], []
    for step in range(steps - 1):
        sync(dev)
        t0 = time.perf_counter()
        ours = rows.step()
        sync(dev)
        t1 = time.perf_counter()
        pos = torch.full((bs, 1), length + step, device=dev)  # [bs, 1]
        out = ref(input_ids=theirs[:, None], position_ids=pos, cache=cache, use_cache=True)
        theirs = out.logits[:, -1].argmax(-1)
        sync(dev)
        ours_t.append(t1 - t0)
        ref_t.append(time.perf_counter() - t1)
        for seq, t in zip(ours_seq, ours, strict=True):
            seq.append(t)
        for seq, t in zip(theirs_seq, theirs.tolist(), strict=True):
            seq.append(t)
    return ours_t, ref_t, ours_seq, theirs_seq


def make_runner(model, page_size: int, bs: int, need: int, graphs: bool,  # type: ignore[no-untyped-def]
                sizes: list[int]) -> ModelRunner:
    pages = bs * need + 1
    pools = KVPools(KVSpec.from_config(model.cfg), pages, pages, page_size, model.device,
                    model.dtype)
    return ModelRunner(model, pools, use_cuda_graph=graphs, graph_batch_sizes=sizes)


def report(label: str, bs: int, times: list[float]) -> float:
    med = statistics.median(times)
    p90 = sorted(times)[int(0.9 * (len(times) - 1))]
    print(f"  {label:<22} bs={bs:<3} step median {med * 1e3:7.2f} ms  p90 {p90 * 1e3:7.2f} ms"
          f"  -> {bs / med:9.1f} tok/s")
    return med


def bench_batch(args: argparse.Namespace, model, ref,  # type: ignore[no-untyped-def]
                prompts: list[list[int]], sizes: list[int]) -> None:
    """Print the runtime (eager, and graphs on CUDA) and the reference for one batch size."""
    bs, cuda = len(prompts), model.device.type == "cuda"
    need = cdiv(args.prompt_len + args.steps, args.page_size)
    results = {}
    for label, graphs in [("runtime eager", False)] + ([("runtime cuda-graph", True)] * cuda):
        runner = make_runner(model, args.page_size, bs, need, graphs, sizes)
        bench_runtime(runner, prompts[:1] * bs, 4)  # warm-up (and graph capture)
        times, tokens = bench_runtime(runner, prompts, args.steps)
        results[label] = (report(label, bs, times), tokens)
        runner.destroy()
    if cuda:
        speedup = results["runtime eager"][0] / results["runtime cuda-graph"][0]
        print(f"  graph speed-up over eager: {speedup:.2f}x")
    if ref is None:
        return
    per_step, ref_tokens = bench_reference(ref, prompts, args.steps)
    report("transformers generate", bs, [per_step])
    best = min(r[0] for r in results.values())
    same = all(r[1] == ref_tokens for r in results.values())
    print(f"  runtime / generate throughput ratio: {per_step / best:.2f}x  "
          f"(greedy tokens identical: {same})")
    runner = make_runner(model, args.page_size, bs, need, cuda, sizes)
    bench_runtime(runner, prompts[:1] * bs, 4)  # warm-up (and graph capture), as above
    ours_t, ref_t, ours, theirs = bench_paired(runner, ref, prompts, args.steps)
    runner.destroy()
    ratio = statistics.median(r / o for r, o in zip(ref_t, ours_t, strict=True))
    # each side against generate's greedy tokens, so a mismatch names the side that differs
    print(f"  paired steps (alternating): runtime {statistics.median(ours_t) * 1e3:.2f} ms, "
          f"reference forward {statistics.median(ref_t) * 1e3:.2f} ms, median ratio "
          f"{ratio:.2f}x (greedy tokens equal to generate's: runtime {ours == ref_tokens}, "
          f"reference forward {theirs == ref_tokens})")


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        args.model = write_model(Path(tmp.name) / "tiny", seed=0)
    model = load_model(args.model, device, dtype)
    ref = None
    if not args.no_reference:
        from transformers import GptOssForCausalLM
        ref = GptOssForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    print(f"model {args.model} device {device} dtype {args.dtype} prompt {args.prompt_len} "
          f"steps {args.steps} threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    for bs in sizes:
        prompts = torch.randint(0, model.cfg.vocab_size, (bs, args.prompt_len),
                                generator=gen).tolist()
        bench_batch(args, model, ref, prompts, sizes)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
