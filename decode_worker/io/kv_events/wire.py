"""SGLang 0.5.23's KV-event wire format (its `disaggregation/kv_events.py` structs).

A batch is a msgpack array `[ts, events, attn_dp_rank]` (`EventBatch`, array_like, all three
always sent); each event a msgpack map tagged by `type` (`KVCacheEvent`, tag=True,
omit_defaults): `BlockStored` always carries `block_hashes`, `parent_block_hash`, `token_ids`,
`block_size`, `lora_id` (nil), and `medium` when set; `BlockRemoved` carries `block_hashes` and
`medium`; `AllBlocksCleared` only `type`. Frames on the PUB socket: `[topic, seq as 8 bytes
big-endian, payload]`; replay answers `[topic, seq8, payload]` per batch, then the end marker
`[b"", END_SEQ, b""]` (after the ROUTER's identity and empty delimiter).
"""

from __future__ import annotations

from typing import Any

import msgspec

from decode_worker.core.radix_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from decode_worker.io.kv_events.hub import KvEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENCODER = msgspec.msgpack.Encoder()


def event_map(event: KVEvent) -> dict[str, Any]:
    """One event as SGLang's tagged map (key order as msgspec writes its struct)."""
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
            "block_size": event.block_size, "lora_id": event.lora_id}
        if event.medium is not None:
            out["medium"] = event.medium
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": event.block_hashes}
        if event.medium is not None:
            out["medium"] = event.medium
        return out
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(batch: KvEventBatch) -> bytes:
    """The msgpack payload of one batch."""
    return _ENCODER.encode([batch.ts, [event_map(e) for e in batch.events], batch.dp_rank])


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
