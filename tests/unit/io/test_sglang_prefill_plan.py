"""What our prefill WRITEs for an SGLang decode (`prefill_plan`), planned against the golden
registration and TransferInfos SGLang's own decode sent (tests/data/sglang_frames)."""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from decode_worker.core.window import sglang_window_start
from decode_worker.errors import TransferError
from decode_worker.io.kv.nixl_agent import CopySpan, WriteSide, coalesce
from decode_worker.io.kv.protocol import RegionLayout
from decode_worker.io.kv.sglang import messages as m
from decode_worker.io.kv.sglang.frames import Registration, TransferInfo
from decode_worker.io.kv.sglang.prefill_plan import (
    AUX_ITEM_LENS,
    AUX_OFFSETS,
    AUX_ROW_BYTES,
    Geometry,
    SourceRoom,
    aux_row_bytes,
    plan_room,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "sglang_frames"
ITEM = 1024  # the captured layout: page 16 x 2 heads x 16 dims x bf16
FULL = RegionLayout("full", 1 << 20, 2, 65, 2 * ITEM, 0, "DRAM")
SWA = RegionLayout("swa", 1 << 30, 2, 65, 2 * ITEM, 0, "DRAM")
GEO = Geometry(FULL, SWA, 16, 127)
AUX_ADDR = 7 << 40
HOST = WriteSide("DRAM", 0, "DRAM", 0)


def frames(name: str) -> list[bytes]:
    doc = json.loads((DATA / f"{name}.frames.json").read_text())
    return [base64.b64decode(f) for f in doc["frames"]]


REG = m.decode_registration(frames("register"))
INFO = m.decode_transfer_info(frames("transfer_info"))  # room 2001, L = 40, P = 0
INFO_PREFIX = m.decode_transfer_info(frames("transfer_info_decode_prefix"))  # L = 100, P = 32


def source(prompt_len: int) -> SourceRoom:
    n = -(-prompt_len // 16)
    return SourceRoom(prompt_len, list(range(10, 10 + n)), list(range(40, 40 + n)), AUX_ADDR)


def spans_of(plan: list[tuple[WriteSide, list[CopySpan]]]) -> list[CopySpan]:
    assert [side for side, _ in plan] == [HOST]  # host pools: one pairing
    return plan[0][1]


def expected_kv(reg: Registration, src_ids: list[int], dst_ids: tuple[int, ...]) -> list[CopySpan]:
    out = []
    for e, ptr in enumerate(reg.kv_ptrs):
        kind, layer = divmod(e, 2)
        out += [CopySpan(FULL.row_addr(layer, a) + kind * ITEM, ptr + b * reg.kv_item_lens[e], ITEM)
                for a, b in zip(src_ids, dst_ids, strict=True)]
    return out


def expected_state(reg: Registration, src_ids: list[int], dst_ids: tuple[int, ...]
                   ) -> list[CopySpan]:  # fmt: skip
    out = []
    for e, ptr in enumerate(reg.state_ptrs):
        kind, layer = divmod(e, 2)
        out += [CopySpan(SWA.row_addr(layer, a) + kind * ITEM, ptr + b * ITEM, ITEM)
                for a, b in zip(src_ids, dst_ids, strict=True)]
    return out


def expected_aux(reg: Registration, row: int) -> list[CopySpan]:
    return [CopySpan(AUX_ADDR + AUX_OFFSETS[i], ptr + row * AUX_ITEM_LENS[i], AUX_ITEM_LENS[i])
            for i, ptr in enumerate(reg.aux_ptrs)]


def test_cold_room_writes_every_page_the_window_and_the_aux_row() -> None:
    src = source(40)
    assert len(INFO.kv_page_ids) == len(INFO.state_page_ids) == 3
    got = spans_of(plan_room(GEO, src, INFO, REG))
    want = (expected_kv(REG, src.full_page_ids, INFO.kv_page_ids)
            + expected_state(REG, src.swa_page_ids, INFO.state_page_ids)
            + expected_aux(REG, INFO.aux_row))  # fmt: skip
    assert got == want
    assert sum(s.length for s in got) == 2 * 2 * 3 * ITEM * 2 + AUX_ROW_BYTES


def test_decode_prefix_writes_only_the_suffix_and_sglangs_window() -> None:
    src = source(100)  # P = 32: pages 2..6 of KV; window start max(32, 100 - 127) = 32
    assert INFO_PREFIX.decode_prefix_len == 32 and len(INFO_PREFIX.kv_page_ids) == 5
    got = spans_of(plan_room(GEO, src, INFO_PREFIX, REG))
    want = (expected_kv(REG, src.full_page_ids[2:], INFO_PREFIX.kv_page_ids)
            + expected_state(REG, src.swa_page_ids[2:], INFO_PREFIX.state_page_ids)
            + expected_aux(REG, INFO_PREFIX.aux_row))  # fmt: skip
    assert got == want


@pytest.mark.parametrize("state_ids", [(), (5, 6)], ids=["no-state", "any-state"])
def test_a_full_hit_writes_the_aux_row_only(state_ids: tuple[int, ...]) -> None:
    """decode_prefix_len = L (page-aligned), no KV ids: SGLang's sender skips the KV and an
    empty SWA window (`maybe_send_extra` passes over a component with no source pages, whatever
    the decode listed) and writes the aux row: the room still succeeds."""
    src = source(96)
    hit = replace(INFO_PREFIX, kv_page_ids=(), state_page_ids=state_ids, decode_prefix_len=96)
    assert spans_of(plan_room(GEO, src, hit, REG)) == expected_aux(REG, hit.aux_row)


@pytest.mark.parametrize(("prefix", "length", "start"),
                         [(0, 40, 0), (0, 300, 160), (64, 400, 272), (160, 200, 160), (0, 127, 0),
                          (0, 128, 0), (0, 144, 16), (256, 256, 256)])
def test_window_start_is_sglangs(prefix: int, length: int, start: int) -> None:
    assert sglang_window_start(prefix, length, 127, 16) == start


def test_fewer_kv_ids_truncate_and_more_are_ignored() -> None:
    src = source(40)
    short = replace(INFO, kv_page_ids=INFO.kv_page_ids[:2])
    assert spans_of(plan_room(GEO, src, short, REG))[:8] == expected_kv(
        REG, src.full_page_ids[:2], short.kv_page_ids)[:8]
    long = replace(INFO, kv_page_ids=(*INFO.kv_page_ids, 99))
    assert plan_room(GEO, src, long, REG) == plan_room(GEO, src, INFO, REG)


def test_state_count_mismatch_fails_with_sglangs_text() -> None:
    bad = replace(INFO, state_page_ids=(*INFO.state_page_ids, 5))
    with pytest.raises(TransferError) as err:
        plan_room(GEO, source(40), bad, REG)
    assert str(err.value) == "State index length mismatch at component 0: prefill=3, dst=4"


@pytest.mark.parametrize(("change", "match"), [
    ({"tp_size": 2}, "decode attention TP 2"),
    ({"kv_ptrs": REG.kv_ptrs[:2], "kv_item_lens": REG.kv_item_lens[:2]}, "2 KV entries"),
    ({"state_ptrs": ()}, "0 state entries"),
    ({"kv_item_lens": (512,) * 4}, "KV item lengths"),
    ({"num_slots": 100}, "page id 107 is outside its 100 slots"),
])
def test_a_decode_this_prefill_cannot_serve_is_refused(change: dict[str, object],
                                                       match: str) -> None:
    with pytest.raises(TransferError, match=match):
        plan_room(GEO, source(40), INFO, replace(REG, **change))  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix", [8, 48, -16])
def test_a_prefix_that_is_not_a_page_aligned_part_of_the_prompt_is_refused(prefix: int) -> None:
    with pytest.raises(TransferError, match="decode_prefix_len"):
        plan_room(GEO, source(40), replace(INFO, decode_prefix_len=prefix), REG)


def test_gpu_pools_write_to_the_kinds_the_decode_announced() -> None:
    full = RegionLayout("full", FULL.addr, 2, 65, 2 * ITEM, 1, "VRAM")
    geo = Geometry(full, RegionLayout("swa", SWA.addr, 2, 65, 2 * ITEM, 1, "VRAM"), 16, 127)
    reg = replace(REG, gpu_id=3, kv_mem_kinds=("DRAM",) * 4)
    sides = [side for side, _ in plan_room(geo, source(40), INFO, reg)]
    assert sides == [WriteSide("VRAM", 1, "DRAM", 0), WriteSide("VRAM", 1, "VRAM", 3), HOST]


def test_aux_row_is_sglangs_ten_buffers() -> None:
    top = [(5, -0.5), (7, -1.25)]
    row = aux_row_bytes(2**63 + 9, 5, -0.5, top, cached_tokens=3)
    assert len(row) == AUX_ROW_BYTES == 1600
    buf = [row[o : o + n] for o, n in zip(AUX_OFFSETS, AUX_ITEM_LENS, strict=True)]
    assert struct.unpack("<16i", buf[0])[:2] == (5, 0)
    assert struct.unpack("<16i", buf[1])[:3] == (3, 3, 0)
    assert struct.unpack("<16f", buf[2])[0] == -0.5
    assert struct.unpack("<16i", buf[3])[0] == 5
    assert struct.unpack("<128f", buf[4])[:3] == (-0.5, -1.25, 0.0)
    assert struct.unpack("<128i", buf[5])[:3] == (5, 7, 0)
    assert buf[6] + buf[7] + buf[8] == bytes(256)
    assert struct.unpack("<8Q", buf[9]) == (2**63 + 9, 0, 0, 0, 0, 0, 0, 0)


def test_dummy_golden_info_round_trips() -> None:
    assert isinstance(INFO, TransferInfo) and not INFO.is_dummy


def test_an_all_layer_model_is_sent_as_sglang_lays_it_out() -> None:
    """Gemma 3 (sliding layers 0 and 2 here) as a stock SGLang prefill sends it: every layer a
    KV entry in model order, K then V, a sliding layer's pages from our SWA pool (it holds the
    whole prompt), no state written whatever state ids the decode lists; a decode registered
    for the hybrid layout is refused."""
    geo = replace(GEO, all_layers=(("swa", 0), ("full", 0), ("swa", 1), ("full", 1)))
    ptrs = tuple((3 << 32) + (1 << 24) * e for e in range(8))
    reg = replace(REG, kv_ptrs=ptrs, kv_item_lens=(ITEM,) * 8, kv_mem_kinds=("VRAM",) * 8,
                  state_ptrs=(), state_item_lens=(), state_data_lens=())
    src = source(100)
    want = []
    for e, ptr in enumerate(ptrs):
        kind, layer = divmod(e, 4)
        region, ids = (SWA, src.swa_page_ids) if layer % 2 == 0 else (FULL, src.full_page_ids)
        want += [CopySpan(region.row_addr(layer // 2, a) + kind * ITEM, ptr + b * ITEM, ITEM)
                 for a, b in zip(ids[2:], INFO_PREFIX.kv_page_ids, strict=True)]
    got = spans_of(plan_room(geo, src, INFO_PREFIX, reg))
    assert got == coalesce(want + expected_aux(reg, INFO_PREFIX.aux_row))
    assert sum(s.length for s in got) == 8 * 5 * ITEM + AUX_ROW_BYTES
    with pytest.raises(TransferError, match="decode registered 4 KV entries, this prefill has 8"):
        plan_room(geo, src, INFO_PREFIX, REG)
