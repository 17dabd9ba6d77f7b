"""The SGLang layout bridge, by arithmetic alone: what SGLang writes through our registration
(entry pointer + virtual id * item length, one prefill page of K or V per item) lands exactly on
our pool's K and V bytes of the right tokens, for r = decode page / prefill page = 1, 2, 4."""

from __future__ import annotations

import pytest

from decode_worker.core.window import sglang_window_start
from decode_worker.errors import IncompatiblePeer, PageError
from decode_worker.io.kv.protocol import ModelCompat, RegionLayout, TransferRequest
from decode_worker.io.kv.sglang.layout import (
    SglangLayout,
    build_layout,
    kv_page_ids,
    state_page_ids,
)
from decode_worker.io.kv.sglang.requests import registration, translate
from decode_worker.utils.mathx import align_down, cdiv

HEADS, HEAD_DIM, ITEMSIZE, PS_D, PAGES, WINDOW = 2, 4, 2, 16, 24, 127
TOKEN_BYTES = HEADS * HEAD_DIM * ITEMSIZE
PAGE_BYTES = 2 * PS_D * TOKEN_BYTES
FULL_BASE, SWA_BASE = 1_000_000, 5_000_000


def regions(num_pages: int = PAGES) -> dict[str, RegionLayout]:
    return {
        "full": RegionLayout("full", FULL_BASE, 2, num_pages + 1, PAGE_BYTES, 0, "VRAM"),
        "swa": RegionLayout("swa", SWA_BASE, 3, num_pages + 1, PAGE_BYTES, 0, "VRAM"),
    }


def compat(page_size: int = PS_D) -> ModelCompat:
    kinds = ["swa", "full", "swa", "full", "swa"]
    return ModelCompat("m", "bfloat16", kinds, HEADS, HEAD_DIM, page_size, WINDOW)


def our_token_addr(region: RegionLayout, layer: int, page: int, kind: int, offset: int) -> int:
    """Our pool: [layers, pages + 1, 2 (K, V), PS_D, heads, head_dim]."""
    return region.row_addr(layer, page) + kind * PS_D * TOKEN_BYTES + offset * TOKEN_BYTES


def sglang_writes(lay: SglangLayout, ptrs: tuple[int, ...], ids: list[int], first: int
                  ) -> dict[int, tuple[int, int, int]]:
    """Every byte SGLang writes for prefill pages first, first + ps_p, ... through `ids`:
    address -> (entry's layer, K/V, token position), as its dlist `ptr + id * item_len` does."""
    n = len(ptrs) // 2
    out: dict[int, tuple[int, int, int]] = {}
    for i, vid in enumerate(ids):
        for e, ptr in enumerate(ptrs):
            start = ptr + vid * lay.item_len
            for b in range(lay.item_len):
                pos = first + i * lay.prefill_page_size + b // TOKEN_BYTES
                out[start + b] = (e % n, e // n, pos)
    return out


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("prompt_len, reused", [(150, 0), (150, 64), (33, 0), (16, 16)])
def test_kv_ids_land_on_our_k_and_v_bytes(ratio: int, prompt_len: int, reused: int) -> None:
    ps_p, regs = PS_D // ratio, regions()
    lay = build_layout(regs, compat(), ps_p)
    pages = [PAGES - i for i in range(cdiv(prompt_len, PS_D))]  # scattered, descending
    ids = kv_page_ids(lay, prompt_len, reused, pages[reused // PS_D:])
    assert len(ids) == cdiv(prompt_len - reused, ps_p)
    written = sglang_writes(lay, lay.kv_ptrs, ids, reused)
    for (layer, kind, pos) in set(written.values()):  # the last page may be partly past L
        if pos < prompt_len:
            page, off = pages[pos // PS_D], pos % PS_D
            addr = our_token_addr(regs["full"], layer, page, kind, off)
            assert all(written[addr + b] == (layer, kind, pos) for b in range(TOKEN_BYTES))
    assert len(written) == len(ids) * 2 * 2 * lay.item_len  # no byte written twice
    lo, hi = regs["full"].addr, regs["full"].addr + regs["full"].length
    assert all(lo <= a < hi for a in written)
    assert not written or min(written) >= regs["full"].row_addr(0, 1)  # never dummy page 0


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("prompt_len, reused",
                         [(300, 0), (300, 192), (100, 0), (260, 256), (256, 256)])
def test_state_ids_cover_sglangs_window_on_our_swa_pages(
    ratio: int, prompt_len: int, reused: int
) -> None:
    ps_p, regs = PS_D // ratio, regions()
    lay = build_layout(regs, compat(), ps_p)
    ws = sglang_window_start(reused, prompt_len, WINDOW, ps_p)
    assert ws == align_down(max(reused, prompt_len - WINDOW), ps_p)
    base = align_down(ws, PS_D)
    swa_pages = [3 + 2 * i for i in range(cdiv(prompt_len, PS_D) - base // PS_D)]
    ids = state_page_ids(lay, prompt_len, ws, swa_pages)
    assert len(ids) == cdiv(prompt_len - ws, ps_p)
    written = sglang_writes(lay, lay.state_ptrs, ids, ws)
    for (layer, kind, pos) in set(written.values()):
        if pos < prompt_len:
            page, off = swa_pages[(pos - base) // PS_D], pos % PS_D
            addr = our_token_addr(regs["swa"], layer, page, kind, off)
            assert all(written[addr + b] == (layer, kind, pos) for b in range(TOKEN_BYTES))
    assert {pos for _, _, pos in written.values()} >= set(range(ws, prompt_len))


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_every_entry_stays_inside_its_region(ratio: int) -> None:
    """The highest id (V of the last sub-page of the last page) is addressable, and even the
    last layer's V entry ends exactly at the pool's end (NIXL refuses anything past it)."""
    regs = regions()
    lay = build_layout(regs, compat(), PS_D // ratio)
    assert lay.item_len * 2 * ratio == PAGE_BYTES
    assert lay.virtual_id(PAGES, ratio - 1) < lay.kv_num_slots
    for region, ptrs, slots in ((regs["full"], lay.kv_ptrs, lay.kv_num_slots),
                                (regs["swa"], lay.state_ptrs, lay.state_num_slots)):
        assert len(ptrs) == 2 * region.num_layers
        assert ptrs[-1] + slots * lay.item_len == region.addr + region.length
        assert ptrs[region.num_layers] == ptrs[0] + PAGE_BYTES // 2  # V: half a page further


def test_a_prefill_page_that_does_not_divide_ours_is_refused_with_both_flags() -> None:
    with pytest.raises(IncompatiblePeer) as err:
        build_layout(regions(), compat(page_size=24), 16)
    text = str(err.value)
    assert "16" in text and "24" in text and "--page-size" in text and "cache.page_size" in text


@pytest.mark.parametrize("bad", [
    {"full": 1}, {"full": -1}, {"dup": True}, {"page": PAGES + 1}, {"page": 0}, {"reused": 8},
])  # fmt: skip
def test_bad_page_lists_are_page_errors(bad: dict[str, int]) -> None:
    lay = build_layout(regions(), compat(), 8)
    pages = [1, 2, 3, 4]
    if "full" in bad:
        pages = pages[: len(pages) + bad["full"]] if bad["full"] < 0 else [*pages, 5]
    if "dup" in bad:
        pages[1] = pages[0]
    if "page" in bad:
        pages[2] = bad["page"]
    with pytest.raises(PageError):
        kv_page_ids(lay, 60, bad.get("reused", 0), pages)


def test_translate_refuses_a_window_start_that_is_not_sglangs() -> None:
    lay = build_layout(regions(), compat(), 8)
    ws = sglang_window_start(0, 200, WINDOW, 8)  # 72, not decode-page aligned
    assert ws == 72
    aux = [(10_000 + 64 * i, 64, 4) for i in range(10)]
    req = TransferRequest(1, 7, "r", 200, 0, ws, list(range(1, 14)), [1, 2, 3, 4, 5, 6, 7, 8, 9],
                          2, 5.0)  # fmt: skip
    info, num_bytes = translate(lay, WINDOW, req, "127.0.0.1", 5, "agent", aux)
    assert info.kv_page_ids[:3] == (4, 5, 8) and len(info.kv_page_ids) == 25
    assert len(info.state_page_ids) == cdiv(200 - 72, 8) and info.state_page_ids[0] == 5
    assert num_bytes == (25 * 2 + 16 * 3) * 2 * lay.item_len + 640
    with pytest.raises(PageError, match="starts at 72"):
        translate(lay, WINDOW, TransferRequest(1, 7, "r", 200, 0, 64, req.full_page_ids,
                                               req.swa_page_ids, 2, 5.0), "h", 5, "a", aux)
    with pytest.raises(PageError, match="aux_row"):
        translate(lay, WINDOW, TransferRequest(1, 7, "r", 200, 0, ws, req.full_page_ids,
                                               req.swa_page_ids, 4, 5.0), "h", 5, "a", aux)


def test_translate_a_full_hit_and_a_model_without_swa_layers() -> None:
    """P = L: no KV ids and an empty window, as SGLang's own decode sends a full hit (its
    sender then writes the aux row only). Without SWA layers there is no window to check:
    every P, a full hit too, goes out with no state ids."""
    aux = [(10_000 + 64 * i, 64, 4) for i in range(10)]
    info, num_bytes = translate(build_layout(regions(), compat(), 8), WINDOW,
                                TransferRequest(1, 7, "r", 192, 192, 192, [], [], 0, 5.0),
                                "h", 5, "a", aux)  # fmt: skip
    assert (info.kv_page_ids, info.state_page_ids, info.decode_prefix_len) == ((), (), 192)
    assert num_bytes == 640  # the aux row
    dense = build_layout({**regions(), "swa": RegionLayout("swa", SWA_BASE, 0, PAGES + 1,
                                                           PAGE_BYTES, 0, "VRAM")},
                         ModelCompat("m", "bfloat16", ["full"] * 2, HEADS, HEAD_DIM, PS_D,
                                     WINDOW), 8)  # fmt: skip
    for length, reused in ((200, 0), (200, 192), (192, 192)):
        pages = list(range(1, 1 + cdiv(length, PS_D) - reused // PS_D))
        info, _ = translate(dense, WINDOW, TransferRequest(1, 7, "r", length, reused, 0, pages,
                                                           [], 0, 5.0), "h", 5, "a", aux)
        assert info.state_page_ids == () and info.decode_prefix_len == reused
        assert len(info.kv_page_ids) == cdiv(length - reused, 8)


def test_registration_announces_one_prefill_page_as_the_stride() -> None:
    lay = build_layout(regions(), compat(), 8)
    reg = registration(lay, "10.0.0.1", 18310, "agent", b"md", [1, 2], 3)
    assert reg.kv_item_len == lay.item_len == PAGE_BYTES // 4
    assert reg.kv_item_lens == (lay.item_len,) * 4 and reg.kv_mem_kinds == ("VRAM",) * 4
    assert reg.num_slots == (2 * PAGES + 1) * 2 and reg.tp_size == 1 and reg.tp_rank == 0
    assert reg.state_data_lens == (lay.state_num_slots * lay.item_len,) * 6


LANDING_BASE = 9_000_000


@pytest.mark.parametrize("ratio", [1, 2])
def test_a_landing_region_takes_every_layer_as_sglangs_ordinary_layout(ratio: int) -> None:
    """Gemma 3 as SGLang lays it out: every model layer a KV entry (K of each, then V) in the
    landing region, no state; the ids of landing pages put each layer's K and V of each token
    on that layer's landing page, and the bytes counted are every layer's."""
    land = RegionLayout("landing", LANDING_BASE, 5, 9, PAGE_BYTES, 0, "VRAM")
    lay = build_layout({**regions(), "landing": land}, compat(), PS_D // ratio)
    assert len(lay.kv_ptrs) == 10 and lay.state_ptrs == () and lay.num_full_pages == 8
    assert lay.kv_ptrs[-1] + lay.kv_num_slots * lay.item_len == land.addr + land.length
    pages = [8, 3, 5]  # landing pages of decode pages 1, 2, 3: [16, 64) of a 60-token prompt
    ids = kv_page_ids(lay, 60, 16, pages)
    written = sglang_writes(lay, lay.kv_ptrs, ids, 16)
    for (layer, kind, pos) in set(written.values()):
        if pos < 60:
            addr = our_token_addr(land, layer, pages[pos // PS_D - 1], kind, pos % PS_D)
            assert all(written[addr + b] == (layer, kind, pos) for b in range(TOKEN_BYTES))
    aux = [(10_000 + 64 * i, 64, 4) for i in range(10)]
    info, num_bytes = translate(lay, WINDOW, TransferRequest(1, 7, "r", 60, 16, 16, pages, [],
                                                             0, 5.0), "h", 5, "a", aux)
    assert info.state_page_ids == () and info.decode_prefix_len == 16
    assert num_bytes == 3 * 5 * PAGE_BYTES + 640  # 3 pages of every layer, the aux row
    reg = registration(lay, "10.0.0.1", 18310, "agent", b"md", [1], 0)
    assert len(reg.kv_ptrs) == 10 and reg.state_ptrs == () and reg.state_data_lens == ()
