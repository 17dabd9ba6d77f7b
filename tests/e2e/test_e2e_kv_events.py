"""A real `decode-worker serve` with `--kv-events-config` behind smg, small pools: an index built
only from the worker's KV events (fetched over the replay socket, decoded from the wire)
predicts `cached_tokens` of every later turn exactly (device pages, then host pages: the host
tier is on by default), through the router, while the tree evicts to the host tier;
`/server_info` reports `kv_events` as SGLang does; `/flush_cache` sends `AllBlocksCleared`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.radix_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from decode_worker.daemon.shared.procs import http_json, scrape_metric
from decode_worker.daemon.shared.router import has_router
from decode_worker.device.tokenizer import Tokenizer
from scripts.scaleout_lib.stack import PAGE_SIZE, Stack
from scripts.scaleout_lib.workload import SYSTEM, user_turns

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed")]
END_SEQ = b"\xff" * 8
_TYPES: dict[str, Any] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                          "AllBlocksCleared": AllBlocksCleared}


class EventsStack(Stack):
    """One decode worker publishing KV events on loopback ports it binds (port 0) and reports
    (`--ports-file`: `decodes[0].ports["kv_events"]` and `["kv_events_replay"]`)."""

    def __init__(self, model: Path) -> None:
        super().__init__(model, 1, pool_pages=96)
        cfg = {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "bind": True,
               "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv"}
        self.decodes[0].args += ["--kv-events-config", json.dumps(cfg)]


def replay(sock: zmq.Socket[bytes], start: int) -> list[tuple[int, list[KVEvent]]]:
    """Every buffered batch from `start`, decoded from the wire."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert sock.poll(10_000), "no replay answer within 10 s"
        frames = sock.recv_multipart()
        if frames[2] == END_SEQ:
            return out
        _, topic, seq, payload = frames
        assert topic == b"kv"
        _ts, events, rank = msgspec.msgpack.decode(payload)
        assert rank == 0
        out.append((int.from_bytes(seq, "big"),
                    [_TYPES[e.pop("type")](**e) for e in events]))


def test_event_index_predicts_cached_tokens_through_smg_with_eviction(e2e_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(e2e_model_dir)
    convs = 2
    systems = [tok.encode(f"Ticket {i}. {SYSTEM}") for i in range(convs)]
    users = [[tok.encode(" " + t) for t in conv] for conv in user_turns(convs, 4, seed=5)]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        with EventsStack(e2e_model_dir) as stack:
            pub_port = stack.decodes[0].ports["kv_events"]
            replay_port = stack.decodes[0].ports["kv_events_replay"]
            info = http_json(f"{stack.decodes[0].url}/server_info")["kv_events"]
            assert info == {"publisher": "zmq", "endpoint_host": "127.0.0.1",
                            "endpoint_port_base": pub_port, "topic": "kv",
                            "block_size": PAGE_SIZE, "dp_size": 1,
                            "replay_endpoint_port_base": replay_port}
            dealer.connect(f"tcp://127.0.0.1:{replay_port}")
            index, next_seq = KVEventIndex(), 0
            histories = [list(s) for s in systems]
            checked = from_host = 0
            with stack.routed("round_robin") as router:
                for turn in range(4):
                    for i in range(convs):
                        for seq, events in replay(dealer, next_seq):
                            assert seq == next_seq
                            index.apply(events)
                            next_seq += 1
                        prompt = histories[i] + users[i][turn]
                        # the worker restores host hits itself: cached = device + host hits
                        predicted = index.match_len_across(prompt)
                        from_host += predicted > index.match_len(prompt)
                        answer = http_json(f"{router.url}/generate", {
                            "input_ids": prompt, "sampling_params": {
                                "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
                        assert answer["meta_info"]["cached_tokens"] == predicted, (turn, i)
                        checked += predicted > 0
                        histories[i] = prompt + answer["output_ids"]
            evicted = scrape_metric(stack.decodes[0].url, "decode_worker_kv_evicted_pages_total",
                                    'pool="full"')
            assert evicted > 0 and checked > 0 and from_host > 0, (evicted, checked, from_host)
            assert index.orphan_stores == index.unknown_removals == 0
            stack.flush()
            tail = [e for _, evs in replay(dealer, next_seq) for e in evs]
            assert tail and isinstance(tail[-1], AllBlocksCleared)
    finally:
        dealer.close()
