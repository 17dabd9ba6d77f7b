"""Where a request waits outside the prealloc queue and the batch: one record per request
(`Parked`) that says what it waits for (`Wait`), and the moves allowed between waits.

```
wait      a live request waits for                 an ended request (answered) waits for
PEER      its prefill peer's protocol; then the    -  (it holds nothing: it leaves at once)
          prealloc queue
LANDING   room in the landing area (its pages      -  (nothing writes its pages but a
          held, nothing posted); then TRANSFER        restore: it leaves, or waits RESTORE)
TRANSFER  its KV transfer; then RESTORE or START   the transfer to stop writing its pages
RESTORE   its host-tier restore; then START        the restore to stop writing its pages
START     its place in the batch (READY)           -  (its pages go back at once)
STEPS     -                                        the launched steps that use its pages
```
A record enters from nowhere (`park`) and moves only along `_MOVES` (`move`; `None` is
"leaves the lot"). An ended request keeps its record until the wait is over, and only then are
its pages handed back: a page is never given out while something may still write it.
`RequestTable.end` and `RequestTable.poll` are the only callers that move records. Compute
thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from decode_worker.core.admission import Admit
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.errors import InvalidTransition


class Wait(enum.Enum):
    PEER = "peer"
    LANDING = "landing"
    TRANSFER = "transfer"
    RESTORE = "restore"
    START = "start"
    STEPS = "steps"

    __hash__ = object.__hash__


_ENTRIES = frozenset(Wait)
_MOVES: dict[Wait | None, frozenset[Wait | None]] = {
    None: _ENTRIES,
    Wait.PEER: frozenset({None}),
    Wait.LANDING: frozenset({Wait.TRANSFER, None}),
    Wait.TRANSFER: frozenset({Wait.RESTORE, Wait.START, None}),
    Wait.RESTORE: frozenset({Wait.START, None}),
    Wait.START: frozenset({None}),
    Wait.STEPS: frozenset({None}),
}
# an ended request never waits for these
_LIVE_ONLY = frozenset({Wait.PEER, Wait.LANDING, Wait.START})
_ENDED_ONLY = frozenset({Wait.STEPS})


@dataclass(slots=True, eq=False)
class Parked:
    """One waiting request. `status` is set once it ended ("finished" / "aborted" /
    "failed"): its pages go back when the wait is over. `since`: when a PEER wait began (the
    protocol probe's clock); `until_step`: the batch's committed-step count at which no
    launched step uses its pages (STEPS); `then`: what makes a live request READY once its
    restore is done (RESTORE); `admit`: the admission whose transfer waits for landing room
    (LANDING)."""

    live: LiveRequest
    wait: Wait
    status: str | None = None
    since: float = 0.0
    until_step: int = 0
    then: Callable[[float], None] | None = None
    transfer_id: int | None = None  # TRANSFER: the transfer it is indexed by
    admit: Admit | None = None


class ParkingLot:
    """The records by wait (each in the order it arrived there) and by transfer id."""

    def __init__(self) -> None:
        self._at: dict[Wait, dict[Parked, None]] = {w: {} for w in Wait}
        self._by_transfer: dict[int, Parked] = {}

    def park(self, live: LiveRequest, wait: Wait, *, status: str | None = None,
             since: float = 0.0, until_step: int = 0,
             then: Callable[[float], None] | None = None, admit: Admit | None = None) -> Parked:
        """`live` (not parked) starts waiting for `wait`."""
        if live.parked is not None:
            raise InvalidTransition(f"rid={live.rid} is parked already")
        rec = Parked(live, wait, status, since, until_step, then, admit=admit)
        self._check(rec, None, wait)
        self._enter(rec, wait)
        return rec

    def move(self, rec: Parked, to: Wait | None) -> None:
        """`rec` waits for `to` now (None: it leaves the lot). Raises `InvalidTransition`
        (nothing changed) for a move `_MOVES` lacks."""
        self._check(rec, rec.wait, to)
        self._at[rec.wait].pop(rec)
        if rec.transfer_id is not None:
            del self._by_transfer[rec.transfer_id]
            rec.transfer_id = None
        rec.admit = None  # only a LANDING wait keeps its admission
        if to is None:
            rec.live.parked = None
            return
        self._enter(rec, to)

    def end(self, rec: Parked, status: str) -> None:
        """`rec`'s request ended: it keeps waiting, now for its pages to be free."""
        if rec.status is not None or rec.wait in _LIVE_ONLY:
            raise InvalidTransition(f"rid={rec.live.rid}: ended while waiting for {rec.wait}")
        rec.status = status

    def at(self, wait: Wait) -> list[Parked]:
        """The records waiting for `wait` (a copy: moving them is allowed meanwhile)."""
        return list(self._at[wait])

    def has(self, wait: Wait) -> bool:
        return bool(self._at[wait])

    def count(self, wait: Wait, *, ended: bool | None = None) -> int:
        """Records waiting for `wait`; only the live or only the ended ones when `ended` says
        which."""
        recs = self._at[wait]
        if ended is None:
            return len(recs)
        return sum((r.status is not None) == ended for r in recs)

    def of_transfer(self, transfer_id: int) -> Parked | None:
        return self._by_transfer.get(transfer_id)

    def transfer_ids(self) -> list[int]:
        """The transfers in flight (or not yet reported stopped) of parked requests."""
        return list(self._by_transfer)

    def ended(self) -> Iterator[Parked]:
        """Every record of an ended request (its pages are still held)."""
        for recs in self._at.values():
            yield from (r for r in recs if r.status is not None)

    def __bool__(self) -> bool:
        return any(self._at.values())

    def check_integrity(self) -> None:
        """Every record sits in the index of its wait, once, its request points back at it, the
        transfer index holds exactly the TRANSFER records, and only LANDING records keep an
        admission. Raises AssertionError."""
        seen: set[int] = set()
        for wait, recs in self._at.items():
            for rec in recs:
                assert rec.wait is wait and rec.live.parked is rec and id(rec) not in seen
                assert (rec.transfer_id is not None) == (wait is Wait.TRANSFER)
                assert rec.admit is None or wait is Wait.LANDING
                assert wait not in (_LIVE_ONLY if rec.status is not None else _ENDED_ONLY)
                seen.add(id(rec))
        assert {id(r) for r in self._by_transfer.values()} == {
            id(r) for r in self._at[Wait.TRANSFER]}
        assert all(r.transfer_id == t for t, r in self._by_transfer.items())

    def _enter(self, rec: Parked, wait: Wait) -> None:
        rec.wait = wait
        self._at[wait][rec] = None
        rec.live.parked = rec
        if wait is Wait.TRANSFER:
            assert rec.live.transfer_id is not None
            rec.transfer_id = rec.live.transfer_id
            self._by_transfer[rec.transfer_id] = rec

    @staticmethod
    def _check(rec: Parked, frm: Wait | None, to: Wait | None) -> None:
        if to not in _MOVES[frm]:
            raise InvalidTransition(f"rid={rec.live.rid}: no move {frm} -> {to}")
        if to in (_LIVE_ONLY if rec.status is not None else _ENDED_ONLY):
            raise InvalidTransition(f"rid={rec.live.rid}: {to} while "
                                    f"{'ended' if rec.status else 'live'}")
