"""Incremental detokenization and stop strings (pure, no I/O).

`IncrementalDetokenizer` never emits half a UTF-8 character: text whose decoding ends in U+FFFD
(an incomplete byte sequence) is held until more tokens complete it, or until `flush()`.
`TextStream` adds stop strings on top (`StopFilter`, also applied to each field of a parsed
chat): text that could be the start of a stop string is held back, so a streamed client never
sees part of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_worker.io.api.backend import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decode a growing token list into text deltas.

    Decodes the window `ids[prefix:]` and compares with `ids[prefix:read]`, so tokenizers whose
    decoding depends on the previous token (leading spaces) still come out right.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text (possibly "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def flush(self) -> str:
        """Everything not yet emitted, incomplete characters included (at the end of a request)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


class StopFilter:
    """Stop strings over a text that arrives in pieces: text that could be the start of a stop
    string is held back. After a match `stopped` is True, `matched` names it, and further
    text is ignored; the stop string is trimmed unless `no_stop_trim`."""

    def __init__(self, stop: Sequence[str] = (), no_stop_trim: bool = False) -> None:
        self._stop = tuple(s for s in stop if s)
        self._no_stop_trim = no_stop_trim
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, new: str, final: bool = False) -> str:
        """The part of `new` (after what was held) that is sure to be shown; `final` at the end
        releases what is held."""
        if self.stopped:
            return ""
        buf = self._held + new
        hit = _earliest(buf, self._stop)
        if hit is not None:
            idx, stop = hit
            out = buf[: idx + len(stop)] if self._no_stop_trim else buf[:idx]
            self.stopped, self.matched, self._held = True, stop, ""
        elif final or not self._stop:
            out, self._held = buf, ""
        else:
            keep = _partial_suffix(buf, self._stop)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        return out


class TextStream:
    """Detokenized text with stop strings applied (`StopFilter`).

    After a stop string matched, `stopped` is True, `matched` names it, and further input is
    ignored. The stop string is trimmed from the text unless `no_stop_trim`.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), no_stop_trim: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._filter = StopFilter(stop, no_stop_trim)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self._filter.stopped

    @property
    def matched(self) -> str | None:
        return self._filter.matched

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        return self._advance(self._detok.push(token_ids), final=False)

    def finish(self) -> str:
        """At the end of generation: release held text (it was no stop string after all)."""
        if self.stopped:
            return ""
        return self._advance(self._detok.flush(), final=True)

    def _advance(self, new: str, final: bool) -> str:
        out = self._filter.push(new, final)
        self.text += out
        return out


def _earliest(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop) of the stop string that is complete first in `text` (smallest end; on a
    tie the longest), or None. "Complete first" is what a character-by-character stream sees,
    so the result does not depend on how the text was split into chunks."""
    best: tuple[int, int, str] | None = None  # (end, -len, stop)
    for stop in stops:
        idx = text.find(stop)
        if idx >= 0 and (best is None or (idx + len(stop), -len(stop)) < best[:2]):
            best = (idx + len(stop), -len(stop), stop)
    return None if best is None else (best[0] - len(best[2]), best[2])


def _partial_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
