"""The transfer book's ordering around a peer's own failure: a transfer the peer reported failed
is never aborted again from this side (the peer keeps the cause it found), while ranks that
have not reported yet are the only ones an ABORT still goes to; pages come back only once every
rank settled or the quiesce deadline passed."""

from __future__ import annotations

from decode_worker.io.kv.peer import Transfer
from decode_worker.io.kv.protocol import RegionLayout, TransferRequest
from decode_worker.io.kv.sglang.frames import AbortAck, KVStatus, Status
from decode_worker.io.kv.sglang.peers import RoomIndex, SglangTransfer
from decode_worker.io.kv.transfers import TransferBook

QUIESCE_S = 5.0


def book_and_aborts() -> tuple[TransferBook, list[int]]:
    aborted: list[int] = []
    regions: dict[str, RegionLayout] = {}
    book = TransferBook(regions, QUIESCE_S, lambda x: aborted.append(x.req.transfer_id),
                        size_of=lambda req: 0)
    return book, aborted


def sent(book: TransferBook, tid: int, room: int, now: float = 0.0) -> Transfer:
    req = TransferRequest(tid, room, f"r{tid}", 64, 0, 0, [1, 2, 3, 4], [1, 2, 3, 4], 0, 30.0)
    xfer = book.add(req, "127.0.0.1:1", now)
    xfer.phase = "sent"
    return xfer


def kinds(book: TransferBook) -> list[str]:
    return [ev.kind for ev in book.take_events()]


def test_a_peer_failure_fails_and_releases_without_an_abort() -> None:
    book, aborted = book_and_aborts()
    sent(book, 1, 101)
    book.on_peer_failed(1, "NIXL write failed", 1.0)
    assert kinds(book) == ["failed", "released"]
    assert aborted == [] and book.is_peer_settled(101)
    book.abort(1, 2.0)  # the request ends afterwards (its answer, a disconnect, drain)
    assert aborted == [] and kinds(book) == []


def test_an_owner_abort_asks_once_and_the_peers_failure_then_releases() -> None:
    book, aborted = book_and_aborts()
    sent(book, 2, 102)
    book.abort(2, 1.0)
    assert aborted == [2] and kinds(book) == []  # pages held until the peer stops
    book.on_peer_failed(2, "aborted by the decode side", 1.5)
    assert kinds(book) == ["released"] and aborted == [2]
    book.abort(2, 2.0)
    assert aborted == [2]


def test_a_silent_peer_is_aborted_and_its_pages_wait_for_the_quiesce_deadline() -> None:
    book, aborted = book_and_aborts()
    sent(book, 3, 103)
    book.check_deadlines(31.0)  # past the 30 s transfer deadline
    assert kinds(book) == ["failed"] and aborted == [3]
    assert not book.is_peer_settled(103)  # it never reported: a later cancel still goes
    book.check_deadlines(31.0 + QUIESCE_S - 0.1)
    assert kinds(book) == []
    book.check_deadlines(31.0 + QUIESCE_S)
    assert kinds(book) == ["released"] and book.stats.quiesce_expired == 1


def test_sglang_ranks_that_reported_are_not_aborted() -> None:
    sg = SglangTransfer(ranks=[(0, 0), (0, 1), (0, 2)])
    assert sg.unsettled() == [(0, 0), (0, 1), (0, 2)]
    sg.record(KVStatus(7, Status.FAILED, 0, "State index length mismatch"), aborting=False)
    sg.record(KVStatus(7, Status.SUCCESS, 2), aborting=False)
    assert sg.failure == "State index length mismatch"
    assert sg.unsettled() == [(0, 1)] and not sg.all_settled
    sg.generation = 5
    sg.record(AbortAck(7, 1, 4), aborting=True)  # an older ABORT's ack: not this one
    assert sg.unsettled() == [(0, 1)]
    sg.record(AbortAck(7, 1, 5), aborting=True)
    assert sg.unsettled() == [] and sg.all_settled


def test_finished_rooms_remember_which_ranks_had_settled() -> None:
    rooms = RoomIndex(max_finished=2)
    for room in (1, 2, 3):
        assert rooms.add(room, room * 10)
        rooms.remove(room, room * 10, frozenset({0}))
    assert rooms.settled_after(3) == frozenset({0})
    assert rooms.settled_after(1) == frozenset()  # forgotten (bounded): unknown = none settled
    assert rooms.settled_after(99) == frozenset() and not rooms.was_finished(99)
