"""The pure parts of the transfer layer: descriptor planning, request validation, the wire
format and the compatibility check (no processes; lives here because it belongs to issue 6)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decode_worker.errors import IncompatiblePeer, PageError, ProtocolError
from decode_worker.io.kv import protocol as p
from decode_worker.io.kv.nixl_agent import CopySpan, coalesce
from decode_worker.io.kv.protocol_check import check_compat, validate_request
from decode_worker.io.kv.sender import SourcePages, plan_writes

ROW = 1024


def regions(addr: int, pages: int = 100, layers: int = 2) -> dict[str, p.RegionLayout]:
    return {
        "full": p.RegionLayout("full", addr, layers, pages + 1, ROW, 0, "DRAM"),
        "swa": p.RegionLayout("swa", addr + 10**8, layers, pages + 1, ROW, 0, "DRAM"),
        "aux": p.RegionLayout("aux", addr + 2 * 10**8, 1, 8, 64, 0, "DRAM"),
    }


def request(
    L: int, P: int, S: int, full: list[int], swa: list[int], prompt_ids: list[int] | None = None
) -> p.TransferRequest:
    return p.TransferRequest(1, 7, "r", L, P, S, full, swa, 0, 5.0, prompt_ids)


def test_contiguous_runs_become_one_descriptor_per_layer() -> None:
    req = request(64, 0, 32, [5, 6, 7, 8], [1, 2])
    src = SourcePages([11, 12, 13, 14], [0, 0, 3, 4], aux_row=2)
    plan = plan_writes(req, 16, regions(0), regions(10**9), src)
    ((_, spans),) = plan.writes
    assert plan.num_descriptors == 2 + 2 + 1  # full x 2 layers, swa x 2 layers, aux
    assert plan.num_bytes == (4 * 2 + 2 * 2) * ROW + 64
    assert spans[0] == CopySpan(11 * ROW, 10**9 + 5 * ROW, 4 * ROW)


def test_a_break_on_either_side_splits_the_run() -> None:
    req = request(64, 16, 48, [5, 7, 8], [1])
    src = SourcePages([1, 2, 3, 9], [0, 0, 0, 4], aux_row=0)
    plan = plan_writes(req, 16, regions(0, layers=1), regions(10**9, layers=1), src)
    # full: src 2,3,9 -> dst 5,7,8: 2->5 alone (dst breaks), 3->7 alone (src breaks), 9->8.
    assert plan.num_descriptors == 3 + 1 + 1


def test_full_hit_moves_no_full_kv() -> None:
    req = request(64, 64, 32, [], [1, 2])
    src = SourcePages([1, 2, 3, 4], [1, 2, 3, 4], 0)
    plan = plan_writes(req, 16, regions(0), regions(10**9), src)
    assert plan.num_bytes == 2 * 2 * ROW + 64


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 3)), max_size=40))
def test_coalesce_keeps_every_byte_in_order(raw: list[tuple[int, int, int]]) -> None:
    spans = [CopySpan(a * 8, b * 8, n * 8) for a, b, n in raw]
    merged = coalesce(spans)
    expand = lambda ss: [(s.src_addr + i, s.dst_addr + i) for s in ss for i in range(s.length)]  # noqa: E731
    assert expand(merged) == expand(spans)
    assert len(merged) <= len([s for s in spans if s.length])


@pytest.mark.parametrize(
    ("L", "P", "S", "full", "swa", "slot", "match"),
    [
        (64, 8, 32, [1, 2, 3, 4], [1, 2], 0, "reused_len=8"),
        (64, 0, 64, [1, 2, 3, 4], [], 0, "swa_window_start=64"),
        (64, 0, 32, [1, 2, 3], [1, 2], 0, "3 full page ids for 4 pages"),
        (64, 0, 32, [1, 2, 3, 101], [1, 2], 0, "out of"),
        (64, 0, 32, [0, 2, 3, 4], [1, 2], 0, "out of"),
        (64, 0, 32, [1, 2, 3, 4], [1, 1], 0, "repeated swa"),
        (64, 0, 32, [1, 2, 3, 4], [1, 2], 8, "aux_row 8"),
        (0, 0, 0, [], [], 0, "prompt_len 0"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(
    L: int, P: int, S: int, full: list[int], swa: list[int], slot: int, match: str
) -> None:
    req = p.TransferRequest(1, 7, "r", L, P, S, full, swa, slot, 5.0)
    with pytest.raises(PageError, match=match):
        validate_request(req, 16, regions(0))


def test_messages_round_trip_and_carry_no_pickle() -> None:
    msgs: list[p.Message] = [
        request(64, 0, 32, [1, 2, 3, 4], [1, 2], prompt_ids=[1, 2]),
        p.Ping(3), p.Abort(1, 2**63 + 1), p.TransferFailed(1, 2, "boom"),
    ]
    for msg in msgs:
        raw = p.encode(msg)
        assert b"pickle" not in raw and p.decode(raw) == msg
    assert msgspec.msgpack.decode(p.encode(p.Ping(3))) == {"t": "Ping", "seq": 3}


def test_a_newer_protocol_version_is_named_in_the_error() -> None:
    raw = msgspec.msgpack.encode({"t": "Hello", "version": 9, "future_field": 1})
    with pytest.raises(ProtocolError, match=f"protocol version 9, we speak {p.PROTOCOL_VERSION}"):
        p.decode(raw)
    with pytest.raises(ProtocolError, match="undecodable"):
        p.decode(b"\xc1garbage")


def test_incompatible_handshake_names_both_sides() -> None:
    ours = p.ModelCompat("m", "bfloat16", ["swa", "full"], 8, 64, 16, 127)
    theirs = p.ModelCompat("m", "float32", ["swa", "full"], 8, 64, 64, 127)
    with pytest.raises(IncompatiblePeer) as err:
        check_compat(ours, theirs, p.PROTOCOL_VERSION)
    assert "dtype: decode='bfloat16' prefill='float32'" in str(err.value)
    assert "page_size: decode=16 prefill=64" in str(err.value)
    check_compat(ours, ours, p.PROTOCOL_VERSION)
    old = p.PROTOCOL_VERSION - 1  # a peer from before the aux row's top logprobs
    with pytest.raises(IncompatiblePeer, match=f"protocol_version: ours={old + 1} peer={old}"):
        check_compat(ours, ours, old)


def test_notifications_decode_only_our_own() -> None:
    n = p.Notif(3, 2**64 - 1, 0, 2, 17)
    assert p.decode_notif(p.encode_notif(n)) == n
    with pytest.raises(ProtocolError):
        p.decode_notif(b"123_kv_0_1_0")


def test_vram_pools_and_a_dram_aux_row_are_two_writes_with_two_parts() -> None:
    def gpu(addr: int) -> dict[str, p.RegionLayout]:
        r = regions(addr)
        return {k: (msgspec.structs.replace(v, kind="VRAM", device_id=1) if k != "aux" else v)
                for k, v in r.items()}  # fmt: skip

    req = request(64, 0, 32, [5, 6, 7, 8], [1, 2])
    plan = plan_writes(req, 16, gpu(0), gpu(10**9), SourcePages([1, 2, 3, 4], [1, 2, 3, 4], 0))
    sides = [side for side, _ in plan.writes]
    assert [(s.src_kind, s.dst_kind, s.dst_device) for s in sides] == [
        ("VRAM", "VRAM", 1), ("DRAM", "DRAM", 0)
    ]
