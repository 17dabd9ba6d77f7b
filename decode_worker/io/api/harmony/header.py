"""Reading a harmony message header: the ids between `<|start|>` and `<|message|>`.

    assistant<|channel|>analysis                                     channel analysis
    <|channel|>commentary to=functions.get_weather <|constrain|>json  a call of get_weather
    assistant to=functions.lookup<|channel|>commentary json           the same, recipient first

The role part (before `<|channel|>`) is absent in the first message of an output (the prompt
ended with `<|start|>assistant`). A recipient `to=X` may stand in the role or the channel part;
`to=assistant` / `to=user` / `to=all` address no tool.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from decode_worker.io.api.backend import Tokenizer
from decode_worker.io.api.harmony.tokens import HarmonyTokens

_RECIPIENT = re.compile(r"\bto=(\S+)")
_NOT_TOOLS = frozenset({"assistant", "user", "all", "system", "developer"})
FUNCTIONS = "functions."


@dataclass(frozen=True, slots=True)
class Header:
    role: str = ""
    channel: str = ""
    recipient: str | None = None  # a tool's name as the model wrote it (functions.NAME)
    content_type: str = ""  # after <|constrain|>, or a trailing word (json, code)

    @property
    def function_name(self) -> str:
        """The recipient without the `functions.` namespace."""
        name = self.recipient or ""
        return name[len(FUNCTIONS):] if name.startswith(FUNCTIONS) else name


def read_header(ids: Sequence[int], tokens: HarmonyTokens, tokenizer: Tokenizer) -> Header:
    """The header's parts; anything it cannot read is left empty (never raises)."""
    role_ids: list[int] = []
    channel_ids: list[int] = []
    type_ids: list[int] = []
    part = role_ids
    for tid in ids:
        if tid == tokens.channel:
            part = channel_ids
        elif tid == tokens.constrain:
            part = type_ids
        elif tid not in tokens.all_ids:
            part.append(tid)
    role, channel = _text(role_ids, tokenizer), _text(channel_ids, tokenizer)
    recipient = None
    for text in (role, channel):
        found = _RECIPIENT.search(text)
        if found is not None and found.group(1) not in _NOT_TOOLS:
            recipient = found.group(1)
    role_words = _RECIPIENT.sub(" ", role).split()
    channel_words = _RECIPIENT.sub(" ", channel).split()
    ctype = _text(type_ids, tokenizer).strip()
    if not ctype and len(channel_words) > 1:
        ctype = channel_words[-1]
    return Header(role=role_words[0] if role_words else "",
                  channel=channel_words[0] if channel_words else "",
                  recipient=recipient, content_type=ctype)


def _text(ids: Sequence[int], tokenizer: Tokenizer) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
