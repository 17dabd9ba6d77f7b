"""Runs under a venv with only `ai-dynamo-runtime` (never imports decode_worker, nor msgspec):
feed this worker's ZMQ KV-event batches, decoded from msgpack by the test, into Dynamo's own KV
indexer (`dynamo.llm.RadixTree`) and score queries.

The wire -> indexer step mirrors Dynamo's ZMQ relay (`lib/kv-router/src/zmq_wire/convert.rs`):
a `BlockStored` becomes a stored event whose blocks are `block_size`-token chunks of `token_ids`
(engine hash = block identity, XXH3 `compute_block_hash_for_seq` = content hash; a chunk that is
not exactly `block_size` long is not published), `BlockRemoved` a removal by engine hash,
`AllBlocksCleared` a clear.

stdin: JSON {"batches": [[ts, events, dp_rank], ...], "queries": [[tokens...], ...]}, each batch
the msgpack payload as decoded (events: maps tagged by "type")
stdout: JSON {"blocks": [matched blocks per query]}
"""

from __future__ import annotations

import json
import sys

from dynamo.llm import RadixTree, compute_block_hash_for_seq


def main() -> None:
    req = json.load(sys.stdin)
    tree, event_id = RadixTree(), 0
    for _ts, events, _rank in req["batches"]:
        for ev in events:
            event_id += 1
            kind = ev["type"]
            if kind == "BlockStored":
                bs, toks = ev["block_size"], ev["token_ids"]
                blocks = []
                for i, h in enumerate(ev["block_hashes"]):
                    chunk = toks[i * bs : (i + 1) * bs]
                    if len(chunk) != bs:
                        break
                    blocks.append({"block_hash": h % 2**64,
                                   "tokens_hash": compute_block_hash_for_seq(chunk, bs)[0]})
                parent = ev["parent_block_hash"]
                data = {"stored": {"parent_hash": None if parent is None else parent % 2**64,
                                   "blocks": blocks}}
            elif kind == "BlockRemoved":
                data = {"removed": {"block_hashes": [h % 2**64 for h in ev["block_hashes"]]}}
            else:
                data = "cleared"
            tree.apply_event(0, json.dumps({"event_id": event_id, "data": data}).encode())
    out = []
    for toks in req["queries"]:
        bs = 4 if not req.get("block_size") else req["block_size"]
        hashes = compute_block_hash_for_seq(toks, bs)
        out.append(tree.find_matches(hashes).scores.get((0, 0), 0))
    json.dump({"blocks": out}, sys.stdout)


if __name__ == "__main__":
    main()
