"""The checks at the protocol's edges: the handshake's compatibility check (both sides, before any
KV moves) and a transfer request's validation against the decode side's regions.

Plain functions over the structs of `protocol`; each raises a typed error (IncompatiblePeer,
PageError) naming the problem.
"""

from __future__ import annotations

from decode_worker.errors import IncompatiblePeer, PageError
from decode_worker.io.kv.protocol import (
    PROTOCOL_VERSION,
    ModelCompat,
    RegionLayout,
    TransferRequest,
)
from decode_worker.utils.mathx import cdiv


def compat_mismatches(decode_side: ModelCompat, prefill_side: ModelCompat) -> list[str]:
    """Every field the two sides disagree on, as "field: decode=X prefill=Y"."""
    out = []
    for field in decode_side.__struct_fields__:
        ours, theirs = getattr(decode_side, field), getattr(prefill_side, field)
        if ours != theirs:
            out.append(f"{field}: decode={ours!r} prefill={theirs!r}")
    return out


def check_compat(decode_side: ModelCompat, prefill_side: ModelCompat, version: int) -> None:
    """Raises IncompatiblePeer with one message naming both sides' values of every mismatch."""
    problems = compat_mismatches(decode_side, prefill_side)
    if version != PROTOCOL_VERSION:
        problems.insert(0, f"protocol_version: ours={PROTOCOL_VERSION} peer={version}")
    if problems:
        raise IncompatiblePeer("incompatible peer: " + "; ".join(problems))


def validate_request(
    req: TransferRequest, page_size: int, regions: dict[str, RegionLayout]
) -> None:
    """Check a transfer request against the decode side's regions before any byte moves.

    Raises PageError naming the first problem: ranges not page-aligned or out of order, a
    page-id list of the wrong length (no SWA ids for a model without sliding layers), an id
    outside `[1, num_pages]` or repeated, or an aux slot outside the aux region.
    """
    ps, n_pages = page_size, cdiv(req.prompt_len, page_size)
    if req.prompt_len <= 0:
        raise PageError(f"room {req.room}: prompt_len {req.prompt_len} must be positive")
    if req.reused_len % ps or not 0 <= req.reused_len <= req.prompt_len:
        raise PageError(f"room {req.room}: reused_len={req.reused_len} not page-aligned in [0, L]")
    if req.swa_window_start % ps or not 0 <= req.swa_window_start < req.prompt_len:
        raise PageError(
            f"room {req.room}: swa_window_start={req.swa_window_start} not page-aligned in [0, L)"
        )
    _check_ids(req, "full", req.full_page_ids, n_pages - req.reused_len // ps, regions["full"])
    # a model without sliding layers (an empty SWA region) moves no SWA pages
    swa_pages = n_pages - req.swa_window_start // ps if regions["swa"].num_layers else 0
    _check_ids(req, "swa", req.swa_page_ids, swa_pages, regions["swa"])
    if not 0 <= req.aux_row < regions["aux"].rows_per_layer:
        raise PageError(f"room {req.room}: aux_row {req.aux_row} out of range")


def _check_ids(
    req: TransferRequest, pool: str, ids: list[int], expected: int, region: RegionLayout
) -> None:
    if len(ids) != expected:
        raise PageError(f"room {req.room}: {len(ids)} {pool} page ids for {expected} pages")
    if any(not 1 <= p < region.rows_per_layer for p in ids):
        raise PageError(f"room {req.room}: {pool} page id out of [1, {region.rows_per_layer - 1}]")
    if len(set(ids)) != len(ids):
        raise PageError(f"room {req.room}: repeated {pool} page ids")
