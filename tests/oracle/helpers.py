"""Reference greedy decoding (transformers, with its own cache) and a page-handing helper."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from decode_worker.utils.mathx import cdiv


@torch.no_grad()
def reference_greedy(ref, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    """Greedy tokens and the logits that chose them: ([steps], [steps, V] f32)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=ref.config)
    out = ref(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        out = ref(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits).float()


@dataclass
class PageBook:
    """Hands out fresh page ids (1, 2, ...) per pool, like a trivial allocator."""

    page_size: int
    next_ids: dict[str, itertools.count] = field(default_factory=dict)  # type: ignore[type-arg]

    def take(self, pool: str, n: int) -> list[int]:
        counter = self.next_ids.setdefault(pool, itertools.count(1))
        return [next(counter) for _ in range(n)]

    def tables(self, seq_len: int) -> tuple[list[int], list[int]]:
        n = cdiv(seq_len, self.page_size)
        return self.take("full", n), self.take("swa", n)

    def grow(self, table: list[int], pool: str, seq_len: int) -> None:
        need = cdiv(seq_len, self.page_size) - len(table)
        table.extend(self.take(pool, max(0, need)))
