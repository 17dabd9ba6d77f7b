"""Aux rows: the first token, its logprob and its alternatives survive the byte layout."""

from __future__ import annotations

from decode_worker.core.sampling import MAX_TOP_LOGPROBS
from decode_worker.device.aux_buffer import _NUM_TOP, ROW_BYTES, AuxBuffer


def test_a_row_round_trips_with_its_top_logprobs() -> None:
    aux = AuxBuffer(4)
    top = [(17, -0.125), (3, -2.5), (255, -7.0625)]
    aux.write(2, room=2**64 - 5, token_id=17, logprob=-0.125, transfer_id=9, top_logprobs=top)
    row = aux.check(2, 2**64 - 5, 9)
    assert row is not None and row.token_id == 17 and row.logprob == -0.125
    assert row.top_logprobs == top  # float64 bit for bit
    assert aux.read(1).top_logprobs == [] and not aux.read(1).ready
    assert aux.memory_region().length == 4 * ROW_BYTES


def test_alternatives_beyond_the_row_are_dropped_and_a_corrupt_count_is_bounded() -> None:
    aux = AuxBuffer(1)
    many = [(i, -float(i)) for i in range(MAX_TOP_LOGPROBS + 5)]
    aux.write(0, room=1, token_id=0, logprob=0.0, transfer_id=1, top_logprobs=many)
    assert aux.read(0).top_logprobs == many[:MAX_TOP_LOGPROBS]
    aux.rows[0, _NUM_TOP] = 10**6  # a peer wrote garbage: never read past the row
    assert len(aux.read(0).top_logprobs) == MAX_TOP_LOGPROBS
    aux.rows[0, _NUM_TOP] = -3
    assert aux.read(0).top_logprobs == []
