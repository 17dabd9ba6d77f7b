"""LiveIndex: which live requests hold a gram, so that requests running at the same time draft
from each other (two agents asking the same thing, n > 1 samples of one prompt, a batch of
near-identical tool calls) without a search that grows with the batch.

Each request's own `TokenArena` already chains the occurrences of its grams; this index only
maps a gram key (of the arenas' longest anchor) to the requests whose published tokens hold
it, oldest started first (a request alone: the request itself, not a list). A search looks up
the key of the pattern's last grams once, then walks the newest holders' own chains. A request
publishes at `flush` (the keys its arena saw for the first time, which the arena collects while
indexing: one list filter, no second hash), so a request's tokens are visible to the others up
to its `shown` position (what was indexed at its last flush); a finished request is ignored at
once and withdrawn at the next flush (its tokens then move to the shared memory, as before).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.core.spec.base import ReqState


def _seq(r: ReqState) -> int:
    return r.seq


class LiveIndex:
    """Gram key (length `n`) -> the live requests that published it (see the module
    docstring). Not thread-safe."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.holders: dict[int, ReqState | list[ReqState]] = {}

    def publish(self, r: ReqState, keys: Iterable[int]) -> None:
        """Add `r` as a holder of `keys` (each new to it: its arena's `new_keys`)."""
        holders, get = self.holders, self.holders.get
        for key in keys:
            v = get(key)
            if v is None:
                holders[key] = r  # the usual case: a gram only this request holds
            elif isinstance(v, list):
                if v[-1].seq < r.seq:
                    v.append(r)  # the usual case: r started after the others
                else:
                    insort(v, r, key=_seq)
            else:
                holders[key] = [v, r] if v.seq < r.seq else [r, v]

    def withdraw(self, r: ReqState) -> None:
        """Remove `r` from every key it holds (its arena's keys of length n)."""
        holders, get = self.holders, self.holders.get
        for key in r.own.heads[self.n]:
            v = get(key)
            if v is r:
                del holders[key]
            elif isinstance(v, list) and r in v:
                v.remove(r)
                if len(v) == 1:
                    holders[key] = v[0]

    def newest(self, key: int) -> Sequence[ReqState]:
        """The holders of `key`, newest started first."""
        v = self.holders.get(key)
        if v is None:
            return ()
        return v[::-1] if isinstance(v, list) else (v,)

    def check_integrity(self, live: Iterable[ReqState], ended: Iterable[ReqState]) -> None:
        """Raise AssertionError unless the holders are exactly the published keys of the live
        requests (plus requests ended since the last flush), in start order."""
        held: dict[int, set[int]] = {}
        for key, v in self.holders.items():
            group = v if isinstance(v, list) else [v]
            assert not isinstance(v, list) or len(v) > 1, f"key={key}: a list of one"
            assert [r.seq for r in group] == sorted({r.seq for r in group}), "holders order"
            for r in group:
                held.setdefault(id(r), set()).add(key)
        allowed = {id(r) for r in ended}
        for r in live:
            own = r.own
            assert 0 <= r.shown <= own.indexed, (r.shown, own.indexed)
            published = own.heads[self.n].keys() - set(own.new_keys or ())
            assert held.pop(id(r), set()) == published, "published keys differ from the index"
        assert allowed >= held.keys(), "a holder neither live nor just ended"
