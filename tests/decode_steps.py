"""Decode steps for tests, through the daemon's one decode entry (`ModelRunner.decode_rows`)."""

from __future__ import annotations

import torch

from decode_worker.device.runner import DecodeRunner, ModelRunner
from decode_worker.utils.mathx import cdiv


def decode_lists(runner: DecodeRunner, token_ids: list[int], positions: list[int],
                 full_tables: list[list[int]], swa_tables: list[list[int]]) -> torch.Tensor:
    """One step for requests given as page lists (request i: input `token_ids[i]` at
    `positions[i]`, its pages `full_tables[i]` / `swa_tables[i]`, an SWA 0 = not held): each
    gets a fresh row of decode inputs, its tables written up to its position. Returns the
    logits, [bs, V] f32 (a copy: a graph's output buffer is reused by the next step)."""
    inputs = runner.new_inputs(len(token_ids))
    rows = [inputs.acquire() for _ in token_ids]
    ps = inputs.page_size
    for row, token, pos, full, swa in zip(rows, token_ids, positions, full_tables, swa_tables,
                                          strict=True):
        inputs.write_full(row, 0, full)
        inputs.write_swa(row, 0, swa[:pos // ps + 1])  # the ring keeps the window's pages
        inputs.write_token(row, token)
    logits, _ = runner.decode_rows(inputs, rows, positions)
    return logits.clone()


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
        logits = decode_lists(runner, [s[-1] for s in seqs], [len(s) - 1 for s in seqs],
                              tables, tables)  # [bs, V]
        out.append(logits)
        for s, row in zip(seqs, logits, strict=True):
            s.append(int(row.argmax()))
    return torch.stack(out)
