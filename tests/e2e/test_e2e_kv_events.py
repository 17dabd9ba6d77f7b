"""A real `decode-worker serve` with `--kv-events-config` behind smg, small pools: an index built
only from the worker's KV events (fetched over the replay socket, decoded from the wire)
predicts `cached_tokens` of every later turn exactly (device pages, then host pages: the host
tier is on by default), through the router, while the tree evicts to the host tier;
`/server_info` reports `kv_events` as SGLang does; `/flush_cache` sends `AllBlocksCleared`.
And the promise an agent's loop needs: the batches on the live PUB stream published before
an answer already say what that request left in the tree, whatever ended it (the strict
same-connection check is gRPC's, `test_grpc_servicer.py`). Both tests share one stack (worker,
prefill peer, smg)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.radix_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from decode_worker.daemon.shared.procs import ServerProcess, http_json, scrape_metric
from decode_worker.daemon.shared.router import Router, has_router
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
        out.append((int.from_bytes(seq, "big"), decode_events(payload)))


@dataclass
class Events:
    """The shared stack: one decode worker publishing events, smg in front, a replay DEALER."""

    stack: EventsStack
    router: Router
    dealer: zmq.Socket[bytes]

    @property
    def worker(self) -> ServerProcess:
        return self.stack.decodes[0]


@pytest.fixture(scope="module")
def events(e2e_model_dir: Path) -> Iterator[Events]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        with EventsStack(e2e_model_dir) as stack:
            dealer.connect(f"tcp://127.0.0.1:{stack.decodes[0].ports['kv_events_replay']}")
            with stack.routed("round_robin") as router:
                yield Events(stack, router, dealer)
    finally:
        dealer.close()


def test_event_index_predicts_cached_tokens_through_smg_with_eviction(
        e2e_model_dir: Path, events: Events) -> None:
    tok = Tokenizer.from_dir(e2e_model_dir)
    convs = 2
    systems = [tok.encode(f"Ticket {i}. {SYSTEM}") for i in range(convs)]
    users = [[tok.encode(" " + t) for t in conv] for conv in user_turns(convs, 4, seed=5)]
    stack, dealer = events.stack, events.dealer
    pub_port = events.worker.ports["kv_events"]
    replay_port = events.worker.ports["kv_events_replay"]
    info = http_json(f"{events.worker.url}/server_info")["kv_events"]
    assert info == {"publisher": "zmq", "endpoint_host": "127.0.0.1",
                    "endpoint_port_base": pub_port, "topic": "kv",
                    "block_size": PAGE_SIZE, "dp_size": 1,
                    "replay_endpoint_port_base": replay_port}
    index, next_seq = KVEventIndex(), 0
    histories = [list(s) for s in systems]
    checked = from_host = 0
    evicted_before = _evicted(events)
    for turn in range(4):
        for i in range(convs):
            for seq, evs in replay(dealer, next_seq):
                assert seq == next_seq
                index.apply(evs)
                next_seq += 1
            prompt = histories[i] + users[i][turn]
            # the worker restores host hits itself: cached = device + host hits
            predicted = index.match_len_across(prompt)
            from_host += predicted > index.match_len(prompt)
            answer = http_json(f"{events.router.url}/generate", {
                "input_ids": prompt, "sampling_params": {
                    "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
            assert answer["meta_info"]["cached_tokens"] == predicted, (turn, i)
            checked += predicted > 0
            histories[i] = prompt + answer["output_ids"]
    evicted = _evicted(events) - evicted_before
    assert evicted > 0 and checked > 0 and from_host > 0, (evicted, checked, from_host)
    assert index.orphan_stores == index.unknown_removals == 0
    stack.flush()
    tail = [e for _, evs in replay(dealer, next_seq) for e in evs]
    assert tail and isinstance(tail[-1], AllBlocksCleared)


def _evicted(events: Events) -> float:
    return scrape_metric(events.worker.url, "decode_worker_kv_evicted_pages_total", 'pool="full"')


class LiveIndex:
    """A router's view built from the live PUB stream alone (no replay).

    `sync(answered_at)` applies, in order, the batches appended before `answered_at` (this
    process's clock when an answer arrived; the worker stamps each batch with its append time
    on the same host): those the SUB socket holds, and those the worker had published by then
    that loopback has not delivered yet (on a loaded machine an I/O thread can wait for a core
    longer than the answer took through smg: waited for, bounded, counted in `num_late`). A
    batch appended after the answer arrived stays pending: the answer could not announce it,
    so a change the tree makes after answering shows as a wrong prediction."""

    def __init__(self, events: Events) -> None:
        self.url = events.worker.url
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(f"tcp://127.0.0.1:{events.worker.ports['kv_events']}")
        self.index = KVEventIndex()
        self.received = 0  # the seq the socket should bring next
        self.pending: list[tuple[int, float, list[KVEvent]]] = []  # received, not applied
        self.num_late = 0

    def start(self, flush: Callable[[], None]) -> None:
        """Flush the worker's cache until the SUB socket receives the `AllBlocksCleared` batch
        (a subscription takes a moment to reach the publisher): the index starts there."""
        for _ in range(20):
            flush()
            if self.sub.poll(1000):
                _, seq_bytes, payload = self.sub.recv_multipart()
                _ts, evs = decode_batch(payload)
                assert isinstance(evs[-1], AllBlocksCleared), evs
                self.received = int.from_bytes(seq_bytes, "big") + 1
                self.index.apply(evs)
                return
        raise AssertionError("no KV event batch on the SUB socket after 20 cache flushes")

    def sync(self, answered_at: float) -> None:
        published = scrape_metric(self.url, "decode_worker_kv_events_published_batches_total")
        deadline = time.monotonic() + 10
        while self.sub.poll(0):
            self._receive()
        if self.received < published:
            self.num_late += 1
        while self.received < published:
            assert self.sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), (
                f"batches {self.received}..{published - 1} published, not delivered in 10 s")
            self._receive()
        while self.pending and self.pending[0][1] < answered_at:
            self.index.apply(self.pending.pop(0)[2])

    def _receive(self) -> None:
        _, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        assert seq == self.received, f"the SUB socket lost batches {self.received}..{seq - 1}"
        self.received += 1
        self.pending.append((seq, *decode_batch(payload)))

    def close(self) -> None:
        self.sub.close()


def test_the_events_received_with_each_answer_predict_the_next_turn(
        e2e_model_dir: Path, events: Events) -> None:
    """An agent's loop: each later turn goes to smg the moment the previous answer came, and
    the events published before that answer (`LiveIndex.sync`) predict its `cached_tokens`
    exactly. Answers end on stop tokens (under overlap the request's pages
    still wait for a launched step when its answer leaves), on stop strings (found by the API,
    which tells the engine) and by length, while the small pool evicts."""
    tok = Tokenizer.from_dir(e2e_model_dir)
    users = [[tok.encode(" " + t) for t in conv] for conv in user_turns(3, 4, seed=11)]
    stops: list[dict[str, Any]] = [{"stop_token_ids": list(range(100, 130))},
                                   {"stop": list("defghijklmnopqrstuvwxyz")}, {}]
    live = LiveIndex(events)
    try:
        live.start(events.stack.flush)  # an empty tree, and the subscription holds
        ends, grown, evicted, answered_at = Counter[str](), 0, _evicted(events), time.time()
        for i, turns in enumerate(users):
            history = last = tok.encode(f"Case {i}. {SYSTEM}")
            for t, user in enumerate(turns):
                prompt = history + user
                live.sync(answered_at)
                predicted = live.index.match_len_across(prompt)
                answer = http_json(f"{events.router.url}/generate", {
                    "input_ids": prompt, "sampling_params": {
                        "max_new_tokens": 24, "temperature": 0, **stops[t % 3]}})
                answered_at = time.time()
                meta = answer["meta_info"]
                assert meta["cached_tokens"] == predicted, (i, t, meta["finish_reason"])
                # pages the previous answer's own tokens filled
                grown += t > 0 and predicted > len(last) - len(last) % PAGE_SIZE
                last = prompt
                ends[_end_kind(meta["finish_reason"])] += 1
                history = prompt + answer["output_ids"]
        print(f"\n[kv events] {live.received} batches; after {live.num_late} of 12 answers "
              "loopback had not delivered every batch published before them yet")
        assert ends["stop token"] and ends["stop string"] and grown, (ends, grown)
        assert _evicted(events) > evicted
        assert live.index.orphan_stores == live.index.unknown_removals == 0
        lag = scrape_metric(events.worker.url, "decode_worker_kv_event_lag_seconds_count",
                            'transport="zmq"')
        assert lag >= live.received  # every batch sent since start, its lag observed
    finally:
        live.close()


def _end_kind(finish: dict[str, Any]) -> str:
    if finish["type"] != "stop":
        return str(finish["type"])
    return "stop string" if isinstance(finish["matched"], str) else "stop token"


def decode_events(payload: bytes) -> list[KVEvent]:
    return decode_batch(payload)[1]


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """A batch's append time (the worker's wall clock) and events."""
    ts, evs, rank = msgspec.msgpack.decode(payload)
    assert rank == 0
    return float(ts), [_TYPES[e.pop("type")](**e) for e in evs]
