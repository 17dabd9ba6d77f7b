"""Runs under the SGLang venv (never imports decode_worker): decode KV-event payloads with SGLang
0.5.23's own `KVEventBatch` and hash token chains with its own page-hash helper.

stdin: JSON {"payloads": [hex, ...], "chains": [[page_size, [tokens...]], ...]}
stdout: JSON {"batches": [builtins of each decoded batch], "hashes": [[int64, ...], ...]}
"""

from __future__ import annotations

import json
import sys

import msgspec
from sglang.srt.disaggregation.kv_events import KVEventBatch
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64


def main() -> None:
    req = json.load(sys.stdin)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = []
    for payload in req["payloads"]:
        batch = decoder.decode(bytes.fromhex(payload))
        events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
        batches.append({"ts": batch.ts, "events": events, "attn_dp_rank": batch.attn_dp_rank})
    hashes = []
    for page_size, tokens in req["chains"]:
        hs = get_hash_str(tokens, None, page_size)
        hashes.append([hash_str_to_int64(h) for h in (hs if isinstance(hs, list) else [hs])])
    json.dump({"batches": batches, "hashes": hashes}, sys.stdout)


if __name__ == "__main__":
    main()
