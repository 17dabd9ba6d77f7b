"""The KV layout bridge: SGLang's per-layer K/V pages seen on this worker's pools (pure).

Our pools (protocol.RegionLayout "full" / "swa") are `[layers, pages + 1, 2, ps_d, heads,
head_dim]`: one decode page of one layer holds K of its ps_d tokens, then V. SGLang addresses a
per-layer K (or V) buffer in items of one *prefill* page, `ps_p` tokens of every head, at
`entry_ptr + page_id * item_len`. With r = ps_d / ps_p, each decode page p of a layer is 2r
prefill-page items, K's sub-pages first:

    layer base + p * page_bytes
    |  K j=0  |  K j=1  | .. | K j=r-1 |  V j=0  | .. | V j=r-1 |     item_len = page_bytes / 2r
    ^ K entry = layer base            ^ V entry = layer base + r * item_len (half a page)

so registering K at the layer base and V half a decode page further, both with stride item_len,
makes the *virtual* page id `2*r*p + j` address sub-page j of decode page p, in K through the K
entry and in V through the V entry. The highest id ever used is `2*r*pages + r - 1`, so every
entry addresses `num_slots = (2*pages + 1) * r` items: the V entry of the last layer then ends
exactly at the pool's end (a count of `(pages + 1) * 2r` would run half a page past it, and
NIXL refuses remote descriptors outside registered memory).

Token ranges of one request (L = prompt_len, P = reused_len, decode-page aligned; ws = SGLang's
window start, prefill-page aligned):

    [0 ....... P ............ ws ........... L)
               |<- full_page_ids: decode pages of [P, L) ------->|   KV ids: cdiv(L - P, ps_p)
                   |<- swa_page_ids: from align_down(ws, ps_d) ->|   state ids: cdiv(L - ws, ps_p)
"""

from __future__ import annotations

from dataclasses import dataclass

from decode_worker.errors import IncompatiblePeer, PageError
from decode_worker.io.kv.protocol import ModelCompat, RegionLayout
from decode_worker.utils.mathx import align_down, cdiv


@dataclass(frozen=True, slots=True)
class SglangLayout:
    """What a registration announces and how a request's pages become virtual ids.

    `kv_ptrs`: K entry of every full layer then V (pool order = model order of full layers),
    or of every layer in the landing region; `state_ptrs`: the same over the SWA layers (none
    with a landing region). Every entry has stride `item_len`;
    `kv_num_slots` / `state_num_slots` items are addressable from each entry.
    """

    decode_page_size: int
    prefill_page_size: int
    item_len: int
    kv_ptrs: tuple[int, ...]
    kv_num_slots: int
    state_ptrs: tuple[int, ...]
    state_num_slots: int
    num_full_pages: int
    num_swa_pages: int

    @property
    def ratio(self) -> int:
        """r: prefill pages per decode page."""
        return self.decode_page_size // self.prefill_page_size

    def virtual_id(self, page: int, sub_page: int) -> int:
        return 2 * self.ratio * page + sub_page


def build_layout(
    regions: dict[str, RegionLayout], compat: ModelCompat, prefill_page_size: int
) -> SglangLayout:
    """The bridge for a prefill of page size `prefill_page_size` (ps_p). With a "landing"
    region (a model SGLang lays out as an ordinary one although it has sliding layers: Gemma 3)
    every layer is a KV entry there, in model order, and nothing is state: SGLang's
    `MHATokenToKVPool` layout, whose pages the decode side copies out once they arrived.

    Raises IncompatiblePeer (a TransferError) when ps_p does not divide our page size, naming
    both values and the flags to change; ValueError if `regions` do not match `compat`.
    """
    ps_d, ps_p = compat.page_size, prefill_page_size
    if ps_p <= 0 or ps_d % ps_p:
        raise IncompatiblePeer(
            f"SGLang prefill page size {ps_p} does not divide this worker's page size {ps_d}: "
            f"set the prefill's --page-size to a divisor of {ps_d} (e.g. {ps_d}), or this "
            f"worker's cache.page_size to a multiple of {ps_p}"
        )
    r = ps_d // ps_p
    land = regions.get("landing")
    full, swa = (land, None) if land is not None else (regions["full"], regions["swa"])
    per_token = compat.num_kv_heads * compat.head_dim
    if full.row_bytes % (2 * ps_d * per_token) or (swa and full.row_bytes != swa.row_bytes):
        raise ValueError(
            f"page of {full.row_bytes} B is not K+V of {ps_d} tokens x {per_token} elements"
        )
    if land is not None and land.num_layers != len(compat.layer_kinds):
        raise ValueError(f"landing region of {land.num_layers} layers for a model of "
                         f"{len(compat.layer_kinds)}")
    item = full.row_bytes // (2 * r)  # one prefill page of K (or V), every head
    return SglangLayout(
        ps_d, ps_p, item,
        kv_ptrs=_entry_ptrs(full, r * item), kv_num_slots=_num_slots(full, r),
        state_ptrs=_entry_ptrs(swa, r * item) if swa else (),
        state_num_slots=_num_slots(swa, r) if swa else 0,
        num_full_pages=full.rows_per_layer - 1,
        num_swa_pages=swa.rows_per_layer - 1 if swa else 0,
    )  # fmt: skip


def _entry_ptrs(region: RegionLayout, half_page: int) -> tuple[int, ...]:
    """K entries (each layer's base), then V entries (half a decode page further)."""
    k = [region.row_addr(layer, 0) for layer in range(region.num_layers)]
    return (*k, *(ptr + half_page for ptr in k))


def _num_slots(region: RegionLayout, r: int) -> int:
    """Items addressable from each entry: up to the V half of the last page, no further."""
    return (2 * (region.rows_per_layer - 1) + 1) * r


def kv_page_ids(
    lay: SglangLayout, prompt_len: int, reused_len: int, full_page_ids: list[int]
) -> list[int]:
    """Virtual ids of the prefill pages of [P, L), one per prefill page (cdiv(L - P, ps_p)).

    Raises PageError if P is not decode-page aligned, or for a wrong count or bad page id.
    """
    ps_d = lay.decode_page_size
    if prompt_len <= 0 or reused_len % ps_d or not 0 <= reused_len <= prompt_len:
        raise PageError(f"reused_len={reused_len} must be a multiple of {ps_d} in [0, "
                        f"prompt_len={prompt_len}]")  # fmt: skip
    expected = cdiv(prompt_len, ps_d) - reused_len // ps_d
    _check_pages("full", full_page_ids, expected, lay.num_full_pages)
    return _virtual_ids(lay, full_page_ids, reused_len, reused_len, prompt_len)


def state_page_ids(
    lay: SglangLayout, prompt_len: int, window_start: int, swa_page_ids: list[int]
) -> list[int]:
    """Virtual ids of the prefill pages of [ws, L) in the SWA pool (cdiv(L - ws, ps_p));
    `swa_page_ids` are our SWA pages from align_down(ws, ps_d). Raises PageError.

    `ws = L` (decode_prefix_len = L, a full hit) is an empty window: SGLang's decode then
    sends an empty state list and its sender writes no SWA (only the aux row)."""
    ps_d, ps_p = lay.decode_page_size, lay.prefill_page_size
    if window_start % ps_p or not 0 <= window_start <= prompt_len:
        raise PageError(f"swa_window_start={window_start} must be a multiple of the prefill "
                        f"page {ps_p} in [0, prompt_len={prompt_len}]")  # fmt: skip
    base = align_down(window_start, ps_d)
    expected = cdiv(prompt_len, ps_d) - base // ps_d
    _check_pages("swa", swa_page_ids, expected, lay.num_swa_pages)
    return _virtual_ids(lay, swa_page_ids, base, window_start, prompt_len)


def _virtual_ids(lay: SglangLayout, pages: list[int], base: int, start: int, end: int) -> list[int]:
    """`pages[i]` holds tokens [base + i*ps_d, base + (i+1)*ps_d); one id per prefill page of
    [start, end), start prefill-page aligned."""
    ps_d, ps_p = lay.decode_page_size, lay.prefill_page_size
    return [lay.virtual_id(pages[(t - base) // ps_d], (t % ps_d) // ps_p)
            for t in range(start, end, ps_p)]  # fmt: skip


def _check_pages(pool: str, ids: list[int], expected: int, num_pages: int) -> None:
    if len(ids) != expected:
        raise PageError(f"{len(ids)} {pool} page ids for {expected} pages")
    if any(not 1 <= p <= num_pages for p in ids):
        raise PageError(f"{pool} page id out of [1, {num_pages}]")
    if len(set(ids)) != len(ids):
        raise PageError(f"repeated {pool} page ids")
