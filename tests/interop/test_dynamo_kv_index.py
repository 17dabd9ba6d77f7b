"""Dynamo's own KV indexer (`dynamo.llm.RadixTree` from `ai-dynamo-runtime`) built from this
worker's ZMQ payloads predicts every TRANSFER match of the tree, after random traffic with
page-granular evictions, tombstones and a flush. The payloads are decoded from msgpack here
(as they went on the wire); Dynamo's side runs in its own venv, `DYNAMO_VENV` (default
`.venv-dynamo`, made by `scripts/setup_dynamo.sh`: `python3 -m venv V && V/bin/pip install
ai-dynamo-runtime`); skipped without it."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import msgspec
import pytest

from decode_worker.core.radix_tree import MatchMode
from decode_worker.io.kv_events.hub import KvEventHub
from decode_worker.io.kv_events.wire import encode_batch
from tests.integration.test_kv_events_zmq import PS, traffic

SCRIPT = Path(__file__).resolve().parent / "dynamo_kv" / "index_events.py"
ROOT = Path(__file__).resolve().parents[2]


def dynamo_python() -> Path | None:
    """The Dynamo venv's interpreter (`DYNAMO_VENV`, default .venv-dynamo), if it exists."""
    python = Path(os.environ.get("DYNAMO_VENV", ROOT / ".venv-dynamo")) / "bin" / "python"
    return python if python.exists() else None


def test_dynamo_indexer_predicts_every_match() -> None:
    python = dynamo_python()
    if python is None:
        pytest.skip("no venv with ai-dynamo-runtime (DYNAMO_VENV, default .venv-dynamo: "
                    "bash scripts/setup_dynamo.sh)")
    from decode_worker.core.pages import PageAllocator
    from decode_worker.core.radix_tree import UnifiedRadixTree

    tree = UnifiedRadixTree(PS, 7, PageAllocator(24, "full"), PageAllocator(12, "swa"),
                            kv_events=True)
    hub = KvEventHub(10_000)
    seqs = traffic(tree, hub, 60, seed=11)
    batches = [msgspec.msgpack.decode(encode_batch(b)) for b in hub.replay(0)]
    rng = random.Random(5)
    queries = seqs + [s[: rng.randrange(1, len(s) + 1)] for s in seqs]
    req = {"batches": batches, "queries": queries, "block_size": PS}
    out = subprocess.run([str(python), str(SCRIPT)], input=json.dumps(req), text=True,
                         capture_output=True, timeout=120, check=True)
    blocks = json.loads(out.stdout)["blocks"]
    want = [tree.match_prefix(q, MatchMode.TRANSFER).prefix_len // PS for q in queries]
    assert blocks == want and any(want)
