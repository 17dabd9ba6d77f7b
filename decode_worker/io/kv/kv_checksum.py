"""The optional end-to-end KV checksum (`transfer.kv_checksum`, native protocol only).

One CRC-32 (zlib) over the bytes of the pages a transfer writes, in a fixed order both sides can
walk with their own page ids:

    for pool in (full, swa): for layer in pool's layers: for page in that pool's page ids:
        crc = crc32(row(layer, page), crc)

The prefill side walks its source pages (`[P, L)` full, `[S, L)` SWA), the decode side the
destination pages of the same request; the rows are byte-identical when the KV arrived intact.
The aux row (first token) is checked on its own (room and transfer id echo). Rows are read from
the registered host memory by address, so both sides' "full" and "swa" regions must be DRAM.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Mapping, Sequence

from decode_worker.errors import ConfigError
from decode_worker.io.kv.protocol import RegionLayout, TransferRequest


def check_host_regions(regions: Mapping[str, RegionLayout]) -> None:
    """Raises ConfigError when a KV region is not host memory (the checksum reads it by address)."""
    for name in ("full", "swa"):
        if regions[name].kind != "DRAM" and regions[name].length:
            raise ConfigError(f"transfer.kv_checksum=true needs KV pools in host memory; the "
                              f"{name} pool is {regions[name].kind}: set it false")


def kv_checksum(
    regions: Mapping[str, RegionLayout], full_page_ids: Sequence[int], swa_page_ids: Sequence[int]
) -> int:
    """CRC-32 of the rows of `full_page_ids` in every full layer, then of `swa_page_ids` in every
    SWA layer (see the module doc). The caller guarantees the ids are inside the regions."""
    crc = 0
    for name, page_ids in (("full", full_page_ids), ("swa", swa_page_ids)):
        r = regions[name]
        for layer in range(r.num_layers):
            for page in page_ids:
                crc = zlib.crc32(ctypes.string_at(r.row_addr(layer, page), r.row_bytes), crc)
    return crc


def landed_checksum(
    enabled: bool, regions: Mapping[str, RegionLayout]
) -> Callable[[TransferRequest], int] | None:
    """The decode side's check: `req -> checksum` of its destination pages, or None when
    `enabled` (transfer.kv_checksum) is off. Raises ConfigError for pools not in host memory."""
    if not enabled:
        return None
    check_host_regions(regions)
    return lambda req: kv_checksum(regions, req.full_page_ids, req.swa_page_ids)
