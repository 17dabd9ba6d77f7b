"""Pure helpers to judge stop strings on decoded text (no torch; usable from the daemon).

The daemon decodes the output so far and asks:
- `find_stop(text, stops, start)`: where the earliest stop string begins (searching from `start`,
  which may be the old text length minus the longest stop string), or None;
- `safe_prefix_len(text, stops)`: how much of `text` can be streamed now, holding back a tail
  that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(index, stop) of the earliest stop string in text[start:], ties to the longest; or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, start))
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(stop) > len(best[1]))):
            best = (i, stop)
    return best


def search_start(prev_len: int, stops: Sequence[str]) -> int:
    """Where to resume `find_stop` after the text grew from `prev_len` characters."""
    longest = max((len(s) for s in stops), default=1)
    return max(0, prev_len - longest + 1)


def safe_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest prefix of `text` whose tail cannot be the start of a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return len(text) - hold


def trim_at_stop(text: str, stops: Sequence[str], keep_stop: bool = False) -> tuple[str, bool]:
    """(text cut at the first stop string, whether one was found); `keep_stop` keeps it."""
    hit = find_stop(text, stops)
    if hit is None:
        return text, False
    i, stop = hit
    return text[: i + len(stop) if keep_stop else i], True
