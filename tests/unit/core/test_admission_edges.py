"""Edge cases of one admission on both protocols (issue 45): what the decode side asks its peer
for must be what that peer's sender accepts, and the SWA the request's next query reads must be
held, fresh or locked in the tree.

Per case a first request (if any) runs and finishes, so the tree holds its KV; then the request
under test is admitted. Native: `validate_request` (what our prefill checks) passes and the SWA
tail `[S, L)` is never empty. SGLang (prefill page = ours): `translate` (what we send SGLang's
prefill) passes with SGLang's window `floor(max(P, L - window))`, which is never empty either:
a full hit on a page-aligned prompt is asked with `decode_prefix_len < L`, as SGLang 0.5.23's
own decode does (at `decode_prefix_len = L` its sender writes no SWA and no KV). Windows of
the form k*page - 1 (gpt-oss: 127), k*page (128; its one-window-plus-one prompt is not a
page multiple) and neither (100); page 64.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from decode_worker.core.admission import Admit
from decode_worker.core.request import DecodeRequest
from decode_worker.core.window import sglang_window_start
from decode_worker.io.kv.protocol import ModelCompat, RegionLayout, TransferRequest
from decode_worker.io.kv.protocol_check import validate_request
from decode_worker.io.kv.sglang.layout import build_layout
from decode_worker.io.kv.sglang.requests import translate
from decode_worker.utils.mathx import align_down, cdiv
from tests.unit.core.test_admission_helpers import PS, Rig, admit_one, make_rig, run_to_finish

POOL_PAGES = 64
ROW = 2 * PS * 4  # K and V of one page, 2 heads x 2 dims x 1 byte: only the geometry matters


def _regions() -> dict[str, RegionLayout]:
    return {name: RegionLayout(name, 1 << (20 + i), 2, POOL_PAGES + 1, ROW, 0, "VRAM")  # type: ignore[arg-type]
            for i, name in enumerate(("full", "swa", "aux"))}


def _new(rid: str, prompt: list[int], sglang: bool) -> DecodeRequest:
    r = DecodeRequest(rid, hash(rid) & 0xFFFF, prompt, 8)
    r.sglang_page_size = PS if sglang else 0
    return r


def _prompt(n: int) -> list[int]:
    return list(range(100, 100 + n))


# case -> (the first request's prompt length or None, the request under test's prompt, from
# the window and the first request)
Case = tuple[Callable[[int], int] | None, Callable[[int, DecodeRequest | None], list[int]]]
CASES: dict[str, Case] = {
    "reused-0": (None, lambda w, f: _prompt(300)),
    "retry-page-aligned": (lambda w: 896, lambda w, f: _prompt(896)),
    "retry-not-aligned": (lambda w: 895, lambda w, f: _prompt(895)),
    "next-turn-page-aligned": (lambda w: 895,
                               lambda w, f: f.prompt_ids + f.output_ids[:1]),  # type: ignore[union-attr]
    "shorter-than-a-page": (lambda w: 40, lambda w, f: _prompt(40)),
    "one-window": (lambda w: w, lambda w, f: _prompt(w)),
    "one-window-plus-one": (lambda w: w + 1, lambda w, f: _prompt(w + 1)),
}


def _admit_case(rig: Rig, case: Case, window: int, sglang: bool) -> Admit:
    first_len, second = case
    first = None
    if first_len is not None:
        first = _new("first", _prompt(first_len(window)), sglang)
        admit_one(rig, first)
        run_to_finish(rig, first, steps=2)
    return admit_one(rig, _new("second", second(window, first), sglang))


def _check_wire(d: Admit, window: int, sglang: bool) -> None:
    """The peer's sender accepts the request and sends a non-empty SWA tail."""
    L = d.req.fill_len
    req = TransferRequest(1, 7, "second", L, d.prefix_len, d.swa_start, d.full_page_ids,
                          d.swa_page_ids, 0, 5.0)  # fmt: skip
    if not sglang:
        validate_request(req, PS, _regions())
        assert d.swa_start < L
        return
    compat = ModelCompat("m", "bfloat16", ["swa", "full"], 2, 2, PS, window)
    regions = _regions()
    lay = build_layout({"full": regions["full"], "swa": regions["swa"]}, compat, PS)
    aux = [(1 << 30, 64, 4)] * 10
    info, _ = translate(lay, window, req, "127.0.0.1", 1, "agent", aux)
    ws = sglang_window_start(d.prefix_len, L, window, PS)
    assert d.prefix_len < L and ws == d.swa_start < L
    assert len(info.state_page_ids) == cdiv(L - ws, PS) > 0
    assert len(info.kv_page_ids) == cdiv(L, PS) - d.prefix_len // PS


@pytest.mark.parametrize("window", [127, 128, 100], ids=["w127", "w128", "w100"])
@pytest.mark.parametrize("sglang", [False, True], ids=["native", "sglang"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_edge_is_asked_as_its_peer_sends_it(name: str, sglang: bool, window: int) -> None:
    rig = make_rig(POOL_PAGES, 32, window=window)
    d = _admit_case(rig, CASES[name], window, sglang)
    L, kv = d.req.fill_len, d.req.kv
    assert kv is not None
    _check_wire(d, window, sglang)
    # every full page of [0, L) is held, and the SWA a query at L reads: [L - window, L)
    assert all(kv.full_page_ids[: cdiv(L, PS)])
    low = max(L - window, 0)
    assert all(kv.swa_page_ids[low // PS : cdiv(L, PS)]), (low, kv.swa_page_ids)
    if CASES[name][0] is not None:  # the tree holds every whole page of the prompt
        # native: all of them (the SWA tail arrives fresh); SGLang: below L, and some
        assert d.prefix_len == align_down(L, PS) if not sglang else (
            0 < d.prefix_len < L or align_down(L - 1, PS) == 0)
    rig.check([d.req])
    run_to_finish(rig, d.req, steps=3, now=2.0)
    rig.check([])
