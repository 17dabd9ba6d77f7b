"""The harmony format's special tokens, by id, as one tokenizer spells them.

gpt-oss (OpenAI's harmony response format) marks the structure of a turn with seven special
tokens; everything between them is ordinary text:

    <|start|>{role}[ to={recipient}]<|channel|>{channel}[ to={recipient}][ <|constrain|>{type}]
    <|message|>{content}<|end|>        (or <|return|>: the turn is over; <|call|>: a tool call)

The ids are looked up in the tokenizer by their text, so any checkpoint whose tokenizer has
them (gpt-oss: 200006, 200007, ...; the built-in tiny model: 257...) works the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
NAMES = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)


@dataclass(frozen=True, slots=True)
class HarmonyTokens:
    """The ids of the seven harmony special tokens in one tokenizer."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    ret: int
    call: int

    @classmethod
    def of(cls, tokenizer: Any) -> HarmonyTokens | None:
        """The ids in `tokenizer` (anything with `token_to_id(text) -> int | None`), or None
        when it lacks one of them (not a harmony model)."""
        lookup = getattr(tokenizer, "token_to_id", None)
        if lookup is None:
            return None
        ids = [lookup(name) for name in NAMES]
        if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            return None
        return cls(*ids)

    @property
    def all_ids(self) -> frozenset[int]:
        return frozenset((self.start, self.end, self.message, self.channel, self.constrain,
                          self.ret, self.call))

    @property
    def closing_ids(self) -> frozenset[int]:
        """Tokens that end a message."""
        return frozenset((self.end, self.ret, self.call))
