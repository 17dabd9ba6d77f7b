"""The SGLang-protocol prefill's room table: a room starts once it has its prompt and its
TransferInfos in either order; ABORTs are acked at once when nothing is in flight, else when
the room finishes; halves that wait too long expire."""

from __future__ import annotations

from dataclasses import replace

from decode_worker.daemon.prefill.sglang_state import ABORTED, Room, RoomTable
from decode_worker.io.kv.sglang.frames import Abort, TransferInfo

INFO = TransferInfo(room=5, ip="10.0.0.2", port=7000, agent_name="d0", kv_page_ids=(1, 2),
                    aux_row=0, required_dst_info_num=1, state_page_ids=(3, 4),
                    decode_prefix_len=0)  # fmt: skip
ABORT = Abort(5, "10.0.0.2", 7000, 3)



def test_prompt_then_info_starts_the_room() -> None:
    table = RoomTable(10.0)
    assert table.add_prompt(5, [1, 2, 3], None, None, 0.0).start is None
    room = table.add_info(INFO, 0.1).start
    assert isinstance(room, Room) and room.prompt == [1, 2, 3] and room.started
    assert room.targets() == [("10.0.0.2", 7000)]


def test_info_then_prompt_starts_the_room() -> None:
    table = RoomTable(10.0)
    assert table.add_info(INFO, 0.0).start is None
    room = table.add_prompt(5, [1], None, None, 0.1).start
    assert room is not None and set(room.infos) == {"d0"}


def test_a_room_waits_for_every_required_info() -> None:
    table = RoomTable(10.0)
    table.add_prompt(5, [1], None, None, 0.0)
    two = replace(INFO, required_dst_info_num=2)
    assert table.add_info(two, 0.0).start is None
    room = table.add_info(replace(two, agent_name="d1", is_dummy=True), 0.0).start
    assert room is not None and room.targets() == [("10.0.0.2", 7000)]  # dummies get no status


def test_abort_of_a_waiting_room_acks_at_once_and_fails_its_prompt() -> None:
    table, got = RoomTable(10.0), []
    table.add_prompt(5, [1], got.append, None, 0.0)
    out = table.abort(ABORT, 0.1)
    assert out.acks == [(("10.0.0.2", 7000), 5, 3)] and out.start is None
    assert [(r.room, reason) for r, reason in out.fail] == [(5, ABORTED)]
    assert table.add_info(INFO, 0.2).start is None  # the room is gone


def test_abort_before_the_prompt_fails_the_prompt_when_it_comes() -> None:
    table = RoomTable(10.0)
    table.add_info(INFO, 0.0)
    assert table.abort(ABORT, 0.1).acks  # nothing in flight
    out = table.add_prompt(5, [1], None, None, 0.2)
    assert out.start is None and [reason for _, reason in out.fail] == [ABORTED]
    assert table.add_prompt(5, [1], None, None, 0.3).fail == []  # the tombstone is used up


def test_abort_of_a_started_room_is_acked_when_it_finishes() -> None:
    table = RoomTable(10.0)
    table.add_prompt(5, [1], None, None, 0.0)
    room = table.add_info(INFO, 0.0).start
    assert room is not None
    out = table.abort(ABORT, 0.1)
    assert out.acks == [] and out.fail == [] and table.is_aborted(room)
    assert table.finish(room) == [(("10.0.0.2", 7000), 5, 3)]


def test_abort_without_an_address_wants_no_ack() -> None:
    table = RoomTable(10.0)
    table.add_prompt(5, [1], None, None, 0.0)
    assert table.abort(Abort(5), 0.1).acks == []


def test_finished_room_without_abort_owes_no_ack() -> None:
    table = RoomTable(10.0)
    table.add_prompt(5, [1], None, None, 0.0)
    room = table.add_info(INFO, 0.0).start
    assert room is not None and table.finish(room) == [] and table.rooms == {}


def test_a_second_prompt_replaces_a_waiting_one_and_is_refused_for_a_started_room() -> None:
    table, first, second = RoomTable(10.0), [], []
    table.add_prompt(5, [1], first.append, None, 0.0)
    out = table.add_prompt(5, [2], second.append, None, 0.1)
    assert [reason for _, reason in out.fail] == ["replaced by a newer request for the same room"]
    room = table.add_info(INFO, 0.2).start
    assert room is not None and room.prompt == [2]
    late = table.add_prompt(5, [3], None, None, 0.3)
    assert late.start is None and "already being prefilled" in late.fail[0][1]
    assert table.add_info(replace(INFO, agent_name="d9"), 0.3).start is None  # ignored


def test_halves_expire_after_the_timeout_but_started_rooms_do_not() -> None:
    table = RoomTable(1.0)
    table.add_info(INFO, 0.0)
    table.add_prompt(6, [1], None, None, 0.5)
    table.add_prompt(7, [1], None, None, 0.0)
    started = table.add_info(replace(INFO, room=7), 0.0).start
    assert started is not None
    assert [r.room for r in table.expire(1.2)] == [5]
    assert [r.room for r in table.expire(1.6)] == [6]
    assert set(table.rooms) == {7}
