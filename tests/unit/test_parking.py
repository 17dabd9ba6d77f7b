"""The parking lot: random parks, moves and ends, each either made exactly as the table of
allowed moves says or refused with nothing changed; the lot's integrity after every step."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from decode_worker.core.request import DecodeRequest
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.parking import _MOVES, Parked, ParkingLot, Wait
from decode_worker.errors import InvalidTransition
from tests.examples import examples

WAITS = [*Wait, None]
LIVE_ONLY, ENDED_ONLY = {Wait.PEER, Wait.LANDING, Wait.START}, {Wait.STEPS}


def _live(i: int) -> LiveRequest:
    cmd = AddRequest(f"r{i}", [1, 2], SamplingParams(max_new_tokens=2), False, None, None,
                     None, 0.0)
    return LiveRequest(DecodeRequest(cmd.rid, 0, [1, 2], 2), cmd, frozenset())


def _allowed(frm: Wait | None, to: Wait | None, ended: bool) -> bool:
    return to in _MOVES[frm] and to not in (LIVE_ONLY if ended else ENDED_ONLY)


class ParkingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lot = ParkingLot()
        self.lives = [_live(i) for i in range(6)]
        self.model: dict[int, tuple[Wait, bool]] = {}  # request -> (its wait, ended)
        self.tids = itertools.count(1)

    def _snapshot(self) -> list[tuple[Wait | None, str | None, int | None]]:
        return [(lv.parked.wait, lv.parked.status, lv.transfer_id) if lv.parked else
                (None, None, lv.transfer_id) for lv in self.lives]

    @rule(i=st.integers(0, 5), to=st.sampled_from(WAITS), ended=st.booleans())
    def park_or_move(self, i: int, to: Wait | None, ended: bool) -> None:
        live, rec = self.lives[i], self.lives[i].parked
        frm = rec.wait if rec is not None else None
        is_ended = rec.status is not None if rec is not None else ended
        if to is Wait.TRANSFER and live.transfer_id is None:
            live.transfer_id = next(self.tids)  # as the fetcher posts one
        before = self._snapshot()
        try:
            if rec is None:
                if to is None:
                    return
                self.lot.park(live, to, status="aborted" if ended else None)
            else:
                self.lot.move(rec, to)
        except InvalidTransition:
            assert not _allowed(frm, to, is_ended)
            assert self._snapshot() == before  # refused: nothing changed
            return
        assert _allowed(frm, to, is_ended)
        if to is None:
            self.model.pop(i)
        else:
            self.model[i] = (to, is_ended)

    @rule(i=st.integers(0, 5))
    def end(self, i: int) -> None:
        rec: Parked | None = self.lives[i].parked
        if rec is None:
            return
        try:
            self.lot.end(rec, "aborted")
        except InvalidTransition:
            assert rec.status is not None or rec.wait in LIVE_ONLY  # ended twice, or no pages
            return
        assert self.model[i] == (rec.wait, False) and rec.wait not in LIVE_ONLY
        self.model[i] = (rec.wait, True)

    @invariant()
    def books_balance(self) -> None:
        self.lot.check_integrity()
        for wait in Wait:
            assert self.lot.count(wait) == sum(w is wait for w, _ in self.model.values())
            assert self.lot.count(wait, ended=True) == sum(
                w is wait and e for w, e in self.model.values())
        assert bool(self.lot) == bool(self.model)
        assert {id(r.live) for r in self.lot.ended()} == {
            id(self.lives[i]) for i, (_, e) in self.model.items() if e}


ParkingMachine.TestCase.settings = settings(
    max_examples=examples(100), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestParking = ParkingMachine.TestCase
