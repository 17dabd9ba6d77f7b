"""What this decode side tells an SGLang prefill rank: its registration and, per request, the
TransferInfo with our pages as virtual prefill-page ids (pure; layout.py has the bridge).
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_worker.core.window import sglang_window_start
from decode_worker.errors import PageError
from decode_worker.io.kv.protocol import TransferRequest
from decode_worker.io.kv.sglang.frames import Registration, TransferInfo
from decode_worker.io.kv.sglang.layout import (
    SglangLayout,
    kv_page_ids,
    state_page_ids,
)

# SGLang writes state (SWA) buffers as VRAM always and refuses host destinations for
# heterogeneous TP, so its own decode announces "VRAM" for every KV entry: so do we. (Pools in
# host memory only work with a prefill that maps the kinds, as the CPU test rig does.)
KV_MEM_KIND = "VRAM"


def registration(
    lay: SglangLayout, ip: str, port: int, agent_name: str, agent_metadata: bytes,
    aux_ptrs: Sequence[int], gpu_id: int,
) -> Registration:  # fmt: skip
    """Our registration with one prefill rank (decode attention TP 1: tp_size 1, rank 0)."""
    n_kv, n_state = len(lay.kv_ptrs), len(lay.state_ptrs)
    return Registration(
        ip=ip, port=port, agent_name=agent_name, agent_metadata=agent_metadata,
        kv_ptrs=lay.kv_ptrs, aux_ptrs=tuple(aux_ptrs), state_ptrs=lay.state_ptrs,
        gpu_id=gpu_id, tp_size=1, tp_rank=0, kv_item_len=lay.item_len,
        state_item_lens=(lay.item_len,) * n_state, num_slots=lay.kv_num_slots,
        kv_mem_kinds=(KV_MEM_KIND,) * n_kv, kv_item_lens=(lay.item_len,) * n_kv,
        state_data_lens=(lay.state_num_slots * lay.item_len,) * n_state,
    )  # fmt: skip


def translate(
    lay: SglangLayout, window: int, req: TransferRequest, ip: str, port: int, agent_name: str,
    aux_buffers: Sequence[tuple[int, int, int]],
) -> tuple[TransferInfo, int]:  # fmt: skip
    """The TransferInfo of one request, and the bytes it moves (KV, SWA window, aux row).

    `window`: earlier tokens a sliding-window query sees (HF sliding_window - 1). Raises
    PageError if the request's window start is not SGLang's, or its pages or aux row do not fit.
    A model without SWA layers has no SWA state (SGLang: no state type), so no window: its
    full hit (P = L) is SGLang's aux-only full hit, no KV ids and `decode_prefix_len = L`.
    So is one that lands in the landing region (SGLang's all-layer layout): its
    `full_page_ids` are landing pages, every layer's KV of [P, L) goes there.
    """
    ps_p, L, P = lay.prefill_page_size, req.prompt_len, req.reused_len
    kv = kv_page_ids(lay, L, P, req.full_page_ids)
    state: list[int] = []
    if lay.state_ptrs:
        ws = sglang_window_start(P, L, window, ps_p)
        if req.swa_window_start != ws:
            raise PageError(f"swa_window_start={req.swa_window_start}, but SGLang's window for "
                            f"L={L}, P={P} starts at {ws} (max(P, L - {window}) floored to "
                            f"the prefill page {ps_p})")  # fmt: skip
        state = state_page_ids(lay, L, ws, req.swa_page_ids)
    num_rows = min((n for _, _, n in aux_buffers), default=0)
    if not 0 <= req.aux_row < num_rows:
        raise PageError(f"aux_row {req.aux_row} out of [0, {num_rows})")
    info = TransferInfo(
        room=req.room, ip=ip, port=port, agent_name=agent_name, kv_page_ids=tuple(kv),
        aux_row=req.aux_row, required_dst_info_num=1, state_page_ids=tuple(state),
        decode_prefix_len=P,
    )  # fmt: skip
    per_page = 2 * lay.item_len  # K and V
    num_bytes = (len(kv) * len(lay.kv_ptrs) // 2 + len(state) * len(lay.state_ptrs) // 2) \
        * per_page + sum(row for _, row, _ in aux_buffers)
    return info, num_bytes
