"""Prefill a few prompts, then decode them greedily step by step (graph and eager tests)."""

from __future__ import annotations

import torch

from decode_worker.device.runner import DecodeBatch, ModelRunner
from decode_worker.utils.mathx import cdiv


def run_steps(runner: ModelRunner, lengths: list[int], steps: int) -> torch.Tensor:
    """Prefill random prompts of `lengths` on pages 1.., then `steps` greedy decode steps.

    Returns the logits of every step, [steps, bs, V] (each step's row i = request i).
    """
    page = runner.pools.page_size
    gen = torch.Generator().manual_seed(0)
    seqs, tables, next_page = [], [], 1
    for n in lengths:
        pages = list(range(next_page, next_page + cdiv(n + steps, page)))
        next_page += len(pages)
        prompt = torch.randint(0, 256, (n,), generator=gen).tolist()
        seqs.append([*prompt, int(runner.prefill(prompt, pages, pages).argmax())])
        tables.append(pages)
    out = []
    for _ in range(steps):
        batch = DecodeBatch([s[-1] for s in seqs], [len(s) - 1 for s in seqs], tables, tables)
        logits = runner.decode(batch)  # [bs, V]
        out.append(logits)
        for s, row in zip(seqs, logits, strict=True):
            s.append(int(row.argmax()))
    return torch.stack(out)
