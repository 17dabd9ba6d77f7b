"""The bench's multi-turn workload: interleaved chats generated locally from a seed.

A chat is a system prompt (one of a few, shared between chats) and turns of a user message
and the assistant's answer. Turn t's prompt is the system prompt, every earlier user message
and answer, then user message t; its answer is what the decode worker generates (the first
token comes with the transfer, as from a prefill). Token ids are uniform in [0, 50_000).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from decode_worker.utils.mathx import cdiv

VOCAB = 50_000


@dataclass(frozen=True, slots=True)
class Shape:
    """Lengths of the workload, in tokens (ranges inclusive)."""

    chats: int = 32
    turns: int = 5
    systems: int = 2
    system_len: int = 200
    user_len: tuple[int, int] = (40, 200)
    answer_len: tuple[int, int] = (40, 160)


@dataclass(frozen=True, slots=True)
class Chat:
    system: list[int]
    turns: list[tuple[list[int], list[int]]]  # (user message, answer) per turn

    def prompt(self, turn: int) -> list[int]:
        """The prompt of `turn` (0-based): the whole history, then its user message."""
        out = list(self.system)
        for user, answer in self.turns[:turn]:
            out += user + answer
        return out + self.turns[turn][0]

    def final_len(self) -> int:
        """Tokens of the whole conversation (what its last turn leaves cached)."""
        return len(self.system) + sum(len(u) + len(a) for u, a in self.turns)


def make_chats(shape: Shape, seed: int) -> list[Chat]:
    """The same chats for the same shape and seed."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    systems = [tokens(shape.system_len) for _ in range(shape.systems)]
    return [Chat(systems[i % len(systems)],
                 [(tokens(rng.randint(*shape.user_len)), tokens(rng.randint(*shape.answer_len)))
                  for _ in range(shape.turns)])
            for i in range(shape.chats)]


def working_set_pages(chats: list[Chat], page_size: int) -> int:
    """Full pages the whole workload leaves cached: every conversation, the shared system
    prompts once."""
    systems = {id(c.system): cdiv(len(c.system), page_size) for c in chats}
    return (sum(cdiv(c.final_len(), page_size) for c in chats)
            - sum(cdiv(len(c.system), page_size) for c in chats) + sum(systems.values()))
