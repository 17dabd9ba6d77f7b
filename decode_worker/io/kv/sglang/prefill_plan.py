"""What a prefill rank speaking SGLang's protocol WRITEs for one room (pure).

Our pools (`[layers, pages+1, 2, page, heads, head_dim]`) seen as SGLang items: one page of K (or
V) of one layer is contiguous, `item = page_bytes / 2`, V half a page after K. For a prompt of
length L, decode prefix P (`decode_prefix_len`, page-aligned) and SGLang's window start
`ws = floor_ps(max(P, L - window))` (window = HF sliding_window - 1 = 127 for gpt-oss):

    logical pages  0 ...... P/ps ...... ws/ps ...... cdiv(L, ps)
    full entries           |------ KV ---------------------|  kv_ptrs[e] + id * kv_item_lens[e]
    swa entries                         |-- state ids -----|  state_ptrs[e] + id * item (ours)
    aux buffers    row `aux_row` of SGLang's 10 buffers:       aux_ptrs[i] + row * AUX_ITEM_LENS[i]

Entries are SGLang's order, K of every layer then V (`e = kind * layers + layer`). A model SGLang
lays out as an ordinary one although it has sliding layers (Gemma 3: `Geometry.all_layers`) has
every layer as a full entry, in model order (a sliding layer's pages come from our SWA pool,
which holds the whole prompt here), and no state. As SGLang's
NIXL prefill does: fewer KV ids than pages truncates, more are ignored; a state id count unlike
ours fails the room ("State index length mismatch ..."); the KV stride is the decode's item
length, the state stride is ours. All WRITEs go from our memory; `plan_room` raises
TransferError with the reason the decode will read in its KV_STATUS.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from decode_worker.core.window import sglang_window_start
from decode_worker.errors import TransferError
from decode_worker.io.kv.nixl_agent import CopySpan, WriteSide, coalesce
from decode_worker.io.kv.protocol import RegionLayout
from decode_worker.io.kv.sglang.frames import Registration, TransferInfo

# SGLang's MetadataBuffers without speculative decoding, sampling masks or a kv checksum:
# output_ids, cached_tokens, logprob val, logprob idx, top val, top idx (x128), topk_p,
# topk_index, hidden states (16 f32), bootstrap_room (u64 x8)
AUX_ITEM_LENS = (64, 64, 64, 64, 512, 512, 64, 128, 64, 64)
AUX_OFFSETS = tuple(sum(AUX_ITEM_LENS[:i]) for i in range(len(AUX_ITEM_LENS)))
AUX_ROW_BYTES = sum(AUX_ITEM_LENS)
TOP_LOGPROBS_WIDTH = 128
Plan = list[tuple[WriteSide, list[CopySpan]]]


def aux_row_bytes(room: int, token_id: int, logprob: float,
                  top: Sequence[tuple[int, float]] = (), cached_tokens: int = 0) -> bytes:
    """Our staging row (`AUX_ROW_BYTES`, buffer i at `AUX_OFFSETS[i]`) as SGLang's `set_buf`
    fills it: first token, cached tokens, its logprob, up to 128 alternatives, the room."""
    top = list(top)[:TOP_LOGPROBS_WIDTH]
    pad = TOP_LOGPROBS_WIDTH - len(top)
    parts = [
        struct.pack("<16i", token_id, *[0] * 15),
        struct.pack("<16i", cached_tokens, cached_tokens, *[0] * 14),
        struct.pack("<16f", logprob, *[0.0] * 15),
        struct.pack("<16i", token_id, *[0] * 15),
        struct.pack("<128f", *[lp for _, lp in top], *[0.0] * pad),
        struct.pack("<128i", *[t for t, _ in top], *[0] * pad),
        bytes(64 + 128 + 64),  # topk_p, topk_index, hidden states: speculative decoding only
        struct.pack("<8Q", room & (2**64 - 1), *[0] * 7),
    ]
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Our prefill's side: the full and SWA pool layouts (one row = one page, K and V),
    the page size and SGLang's window (HF sliding_window - 1). `all_layers`: SGLang's
    all-layer layout, each model layer's (pool, index in it); empty: the hybrid layout."""

    full: RegionLayout
    swa: RegionLayout
    page_size: int
    window: int
    all_layers: tuple[tuple[str, int], ...] = ()

    def kv_entries(self) -> list[tuple[RegionLayout, int, bool]]:
        """Per KV entry (K of each layer, then V): our region, the layer's index in it, and
        whether its pages are our SWA pages."""
        layers = (self.all_layers or
                  [("full", i) for i in range(self.full.num_layers)])  # fmt: skip
        return [(self.swa if pool == "swa" else self.full, index, pool == "swa")
                for _ in range(2) for pool, index in layers]


@dataclass(frozen=True, slots=True)
class SourceRoom:
    """Our copy of one prompt: page ids of [0, L) in each pool, its staged aux row's address."""

    prompt_len: int
    full_page_ids: list[int]
    swa_page_ids: list[int]
    aux_addr: int


def plan_room(geo: Geometry, src: SourceRoom, info: TransferInfo, reg: Registration) -> Plan:
    """The WRITEs of one TransferInfo, grouped per memory pairing, runs coalesced.
    Raises TransferError (SGLang's text where SGLang has one)."""
    _check_peer(geo, reg)
    ps, n_pages, p_len = geo.page_size, -(-src.prompt_len // geo.page_size), info.decode_prefix_len
    if not 0 <= p_len <= src.prompt_len or p_len % ps:
        raise TransferError(f"decode_prefix_len {p_len} is not a page-aligned prefix of the "
                            f"{src.prompt_len}-token prompt (page {ps})")  # fmt: skip
    if info.aux_row < 0:
        raise TransferError(f"aux row {info.aux_row} is negative")
    dst_kv = list(info.kv_page_ids[: n_pages - p_len // ps])
    src_kv = src.full_page_ids[p_len // ps : p_len // ps + len(dst_kv)]
    ws = sglang_window_start(p_len, src.prompt_len, geo.window, ps)
    state = geo.swa.num_layers and not geo.all_layers  # the hybrid layout's SWA state
    src_swa = src.swa_page_ids[ws // ps : n_pages] if state else []
    if src_swa and len(src_swa) != len(info.state_page_ids):
        raise TransferError(f"State index length mismatch at component 0: "
                            f"prefill={len(src_swa)}, dst={len(info.state_page_ids)}")
    _check_ids("KV", dst_kv, reg.num_slots)
    groups: dict[WriteSide, list[CopySpan]] = {}
    kinds = reg.kv_mem_kinds or ("VRAM",) * len(reg.kv_ptrs)
    first = p_len // ps
    swa_kv = src.swa_page_ids[first : first + len(dst_kv)]
    entries = zip(geo.kv_entries(), reg.kv_ptrs, reg.kv_item_lens, strict=True)
    for e, ((region, layer, is_swa), ptr, stride) in enumerate(entries):
        groups.setdefault(_side(region, kinds[e], reg.gpu_id), []).extend(
            _entry_spans(region, layer, e >= len(reg.kv_ptrs) // 2, swa_kv if is_swa else src_kv,
                         ptr, dst_kv, stride))
    if src_swa:
        side = _side(geo.swa, "VRAM", reg.gpu_id)  # SGLang: state memory is always VRAM
        groups.setdefault(side, []).extend(_state_spans(geo.swa, src_swa, info, reg))
    groups.setdefault(WriteSide("DRAM", 0, "DRAM", 0), []).extend(
        CopySpan(src.aux_addr + AUX_OFFSETS[i], ptr + info.aux_row * AUX_ITEM_LENS[i],
                 AUX_ITEM_LENS[i]) for i, ptr in enumerate(reg.aux_ptrs[: len(AUX_ITEM_LENS)])
    )  # fmt: skip
    return [(side, coalesce(spans)) for side, spans in groups.items() if spans]


def _state_spans(region: RegionLayout, src_ids: list[int], info: TransferInfo,
                 reg: Registration) -> list[CopySpan]:
    """The SWA window, every entry; the decode's stride is our item length (SGLang's generic
    state path)."""
    item, dst_ids = region.row_bytes // 2, list(info.state_page_ids)
    if reg.state_data_lens:
        _check_ids("state", dst_ids, min(reg.state_data_lens) // item)
    return [span for e, ptr in enumerate(reg.state_ptrs)
            for span in _entry_spans(region, e % region.num_layers, e >= region.num_layers,
                                     src_ids, ptr, dst_ids, item)]


def _entry_spans(region: RegionLayout, layer: int, is_v: bool, src_ids: list[int],
                 dst_ptr: int, dst_ids: list[int], dst_stride: int) -> list[CopySpan]:
    """One SGLang entry (K or V of one layer): a span per page, ours -> the decode's."""
    item = region.row_bytes // 2
    return [CopySpan(region.row_addr(layer, a) + is_v * item, dst_ptr + b * dst_stride, item)
            for a, b in zip(src_ids, dst_ids, strict=False)]


def _side(region: RegionLayout, announced: str, gpu_id: int) -> WriteSide:
    """Host-memory pools (model.device = cpu: test rigs) write to host memory whatever the
    decode announced; a CPU-only UCX has no VRAM (SGLang's CPU rig registers DRAM)."""
    kind = "DRAM" if region.kind == "DRAM" else announced
    return WriteSide(region.kind, region.device_id, kind, gpu_id if kind == "VRAM" else 0)


def _check_ids(what: str, ids: Sequence[int], num_slots: int) -> None:
    bad = [i for i in ids if not 0 <= i < num_slots]
    if bad:
        raise TransferError(f"decode {what} page id {bad[0]} is outside its {num_slots} slots")


def _check_peer(geo: Geometry, reg: Registration) -> None:
    """Refuse what this prefill cannot write (the message names both sides' values)."""
    if reg.tp_size != 1 or reg.dcp_size != 1:
        raise TransferError(f"decode attention TP {reg.tp_size} (dcp {reg.dcp_size}): this "
                            "prefill has attention TP 1 and writes whole heads only")
    want = {"KV": 2 * len(geo.all_layers or range(geo.full.num_layers)),
            "state": 0 if geo.all_layers else 2 * geo.swa.num_layers}
    got = {"KV": len(reg.kv_ptrs), "state": len(reg.state_ptrs)}
    for what in want:
        if got[what] != want[what]:
            raise TransferError(f"decode registered {got[what]} {what} entries, this prefill "
                                f"has {want[what]} (K and V of each layer): another model?")
    item = geo.full.row_bytes // 2
    if len(reg.kv_item_lens) != len(reg.kv_ptrs) or min(reg.kv_item_lens, default=item) < item:
        raise TransferError(f"decode KV item lengths {sorted(set(reg.kv_item_lens))} B: this "
                            f"prefill writes {item} B per page (page size, heads or dtype differ)")
    if reg.kv_mem_kinds and len(reg.kv_mem_kinds) != len(reg.kv_ptrs):
        raise TransferError(f"decode announced {len(reg.kv_mem_kinds)} KV memory kinds for "
                            f"{len(reg.kv_ptrs)} entries")
