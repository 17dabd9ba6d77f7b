"""The ZMQ KV-event publisher on loopback: SGLang 0.5.23's own structs decode every batch (its
venv; skipped without it), its own page-hash helper gives the published hashes, replay answers
as 0.5.23 (malformed requests get the end marker), a slow subscriber costs counted drops and
never blocks the compute thread, and a busy port is a start-up error naming the key."""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from decode_worker.core.kv_event_index import KVEventIndex
from decode_worker.core.pages import PageAllocator
from decode_worker.core.radix_events import BlockStored
from decode_worker.core.radix_tree import UnifiedRadixTree
from decode_worker.errors import ConfigError
from decode_worker.io.kv_events.config import describe
from decode_worker.io.kv_events.hub import KvEventHub
from decode_worker.io.kv_events.publisher import ZmqKvEventPublisher
from decode_worker.io.kv_events.wire import END_SEQ, event_map
from decode_worker.settings.kv_events import parse_kv_events_config
from tests.interop.sglang_peer import venv_python

PS = 4
DECODER = Path(__file__).resolve().parents[1] / "interop" / "sglang_kv_events" / "decode_events.py"


def wait_for(cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture()
def stack() -> Iterator[tuple[UnifiedRadixTree, KvEventHub, ZmqKvEventPublisher]]:
    cfg = parse_kv_events_config(json.dumps({
        "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint":
        "tcp://127.0.0.1:*", "topic": "kv@w0@m", "buffer_steps": 64}))
    tree = UnifiedRadixTree(PS, 7, PageAllocator(24, "full"), PageAllocator(12, "swa"),
                            kv_events=True)
    hub = KvEventHub(cfg.buffer_steps)
    pub = ZmqKvEventPublisher.bind(cfg)
    pub.start(hub)
    yield tree, hub, pub
    pub.close()


def traffic(tree: UnifiedRadixTree, hub: KvEventHub, steps: int, seed: int) -> list[list[int]]:
    """Random inserts sharing prefixes, device evictions (page-granular), tombstones, a flush;
    one published batch per step. Returns the inserted token lists."""
    rng = random.Random(seed)
    seqs: list[list[int]] = []
    for step in range(steps):
        toks = [rng.choice([1, 2]) for _ in range(rng.choice([4, 8, 12]))]
        toks += [rng.randrange(100) for _ in range(rng.choice([0, 4, 8]))]
        n = len(toks) // PS
        if tree.full.num_free < n:
            tree.evict_full(n - tree.full.num_free)
        if tree.swa is not None and tree.swa.num_free < n:
            tree.evict_swa(n - tree.swa.num_free)
        tree.insert(toks, tree.full.alloc(n), tree.swa.alloc(n) if tree.swa else [], 0)
        seqs.append(toks)
        if step == steps // 2:
            tree.flush()
        hub.publish_step(tree)
    return seqs


def subscriber(pub: ZmqKvEventPublisher, topic: bytes = b"kv@") -> zmq.Socket[bytes]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub.endpoint)
    seen = pub.num_subscriptions
    wait_for(lambda: pub.num_subscriptions > seen)
    return sub


def recv(sock: zmq.Socket[bytes], n: int) -> list[list[bytes]]:
    out = []
    for _ in range(n):
        assert sock.poll(10_000), "no frame within 10 s"
        out.append(sock.recv_multipart())
    return out


def test_sglang_structs_decode_every_batch_and_its_hashes_match(
    stack: tuple[UnifiedRadixTree, KvEventHub, ZmqKvEventPublisher],
) -> None:
    python = venv_python()
    if python is None:
        pytest.skip("the SGLang venv (scripts/setup_sglang.sh) is missing")
    tree, hub, pub = stack
    sub = subscriber(pub)
    seqs = traffic(tree, hub, 30, seed=7)
    n = hub.next_seq
    frames = recv(sub, n)
    sub.close()
    assert [f[0] for f in frames] == [b"kv@w0@m"] * n
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(n))
    expected = [[event_map(e) for e in b.events] for b in hub.replay(0)]
    req = {"payloads": [f[2].hex() for f in frames], "chains": [[PS, s] for s in seqs]}
    out = subprocess.run([str(python), str(DECODER)], input=json.dumps(req), text=True,
                         capture_output=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert len(got["batches"]) == n
    for batch, want in zip(got["batches"], expected, strict=True):
        assert batch["attn_dp_rank"] == 0
        for ev, w in zip(batch["events"], want, strict=True):
            # SGLang's later optional fields (cache_salt, session_id, ...) decode as None
            assert {k: v for k, v in ev.items() if k in w or v is not None} == w
    sglang = {h for hs in got["hashes"] for h in hs}
    published = {h for b in hub.replay(0) for e in b.events if isinstance(e, BlockStored)
                 for h in e.block_hashes}
    assert published and published <= sglang  # every hash is SGLang's hash of a cached prefix
    index = KVEventIndex()
    for f in frames:
        index.apply(_events(f[2]))
    for toks, hs in zip(seqs, got["hashes"], strict=True):
        full = len(toks) // PS
        if index.match_len(toks) == full * PS:  # still cached: SGLang names its pages the same
            assert all(h in index.pages["GPU"] for h in hs[:full])


def _events(payload: bytes) -> list[object]:
    from decode_worker.core.radix_events import AllBlocksCleared, BlockRemoved

    _ts, events, _rank = msgspec.msgpack.decode(payload)
    out: list[object] = []
    for e in events:
        kind = e.pop("type")
        cls = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
               "AllBlocksCleared": AllBlocksCleared}[kind]
        out.append(cls(**e))
    return out


def test_replay_answers_as_sglang_and_malformed_requests_get_the_end_marker(
    stack: tuple[UnifiedRadixTree, KvEventHub, ZmqKvEventPublisher],
) -> None:
    tree, hub, pub = stack
    traffic(tree, hub, 6, seed=3)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    for bad in ([b"", b"abc"], [b"", b"x", b"y"], [b"nonsense"]):
        dealer.send_multipart(bad)
        assert recv(dealer, 1)[0] == [b"", b"", END_SEQ, b""]
    dealer.send_multipart([b"", (2).to_bytes(8, "big")])
    frames = recv(dealer, hub.next_seq - 2 + 1)
    assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == list(range(2, hub.next_seq))
    assert all(f[:2] == [b"", b"kv@w0@m"] for f in frames[:-1])
    assert frames[-1] == [b"", b"", END_SEQ, b""]
    assert pub.num_bad_replay_requests == 3
    dealer.close()


def test_a_stuck_subscriber_costs_counted_drops_never_a_slow_step() -> None:
    cfg = parse_kv_events_config({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                                  "hwm": 2, "buffer_steps": 100_000})
    tree = UnifiedRadixTree(PS, 7, PageAllocator(500, "full"), None, kv_events=True)
    hub = KvEventHub(cfg.buffer_steps)
    pub = ZmqKvEventPublisher.bind(cfg)
    stuck = zmq.Context.instance().socket(zmq.SUB)
    try:
        pub.start(hub)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(pub.endpoint)
        wait_for(lambda: pub.num_subscriptions > 0)
        worst = 0.0
        big = list(range(PS * 500))  # 500 pages (~25 KB) per batch: fills socket buffers fast
        steps = 0
        deadline = time.monotonic() + 60.0
        # until the loopback buffers (several MB, autotuned) are full: how soon depends on the load
        while time.monotonic() < deadline and not (steps >= 50 and pub.num_dropped_batches > 0):
            tree.flush()
            tree.insert([steps % 7, *big], tree.full.alloc(500), [], 0)
            t0 = time.perf_counter()
            hub.publish_step(tree)
            worst = max(worst, time.perf_counter() - t0)
            steps += 1
        wait_for(lambda: pub.num_published_batches + pub.num_dropped_batches >= steps, 30.0)
        assert pub.num_dropped_batches > 0
        assert worst < 0.05  # appending to the log never waits for the subscriber
    finally:
        stuck.close()
        pub.close()


def test_a_busy_port_is_a_start_up_error_naming_the_key() -> None:
    first = ZmqKvEventPublisher.bind(parse_kv_events_config(
        {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}))
    try:
        port = first.endpoint.rsplit(":", 1)[1]
        with pytest.raises(ConfigError, match=r"key 'endpoint'.*cannot bind.*in use"):
            ZmqKvEventPublisher.bind(parse_kv_events_config(
                {"publisher": "zmq", "endpoint": f"tcp://*:{port}"}))
        with pytest.raises(ConfigError, match=r"key 'replay_endpoint'.*cannot bind"):
            ZmqKvEventPublisher.bind(parse_kv_events_config(
                {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                 "replay_endpoint": f"tcp://*:{port}"}))
    finally:
        first.close()


@pytest.mark.parametrize("any_port", ["0", "*"])
def test_endpoints_on_any_free_port_report_the_ports_they_bound(any_port: str) -> None:
    """Port 0 (or `*`) binds a free port; `bound_ports` (what `--ports-file` writes) and
    `bound_config` (what /server_info describes) name the bound ports, and they take
    connections; the configured host stays as given."""
    pub = ZmqKvEventPublisher.bind(parse_kv_events_config(
        {"publisher": "zmq", "endpoint": f"tcp://*:{any_port}", "replay_endpoint":
         f"tcp://127.0.0.1:{any_port}", "bind": True}))
    try:
        ports = pub.bound_ports()
        assert set(ports) == {"kv_events", "kv_events_replay"}
        assert 0 not in ports.values() and ports["kv_events"] != ports["kv_events_replay"]
        info = describe(pub.bound_config(), PS)
        assert info is not None and info["endpoint_host"] == "*"
        assert info["endpoint_port_base"] == ports["kv_events"]
        assert info["replay_endpoint_port_base"] == ports["kv_events_replay"]
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:  # the replay socket answers on the reported port: the end marker, nothing buffered
            pub.start(KvEventHub(8))
            dealer.connect(f"tcp://127.0.0.1:{ports['kv_events_replay']}")
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(10_000), "no replay answer on the reported port"
            assert dealer.recv_multipart()[2] == END_SEQ
        finally:
            dealer.close()
    finally:
        pub.close()


def test_a_connected_or_fixed_endpoint_reports_no_bound_port_of_its_own() -> None:
    pub = ZmqKvEventPublisher.bind(parse_kv_events_config(
        {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5999", "bind": False}))
    try:
        assert pub.bound_ports() == {}
        assert pub.bound_config() == pub.cfg
    finally:
        pub.close()


@pytest.mark.parametrize(("raw", "match"), [
    ('{"publisher": "zmq", "hwm": "lots"}', r"key 'hwm'"),
    ('{"publisher": "kafka"}', r"key 'publisher'"),
    ('{"publisher": "zmq", "endpont": "tcp://*:5557"}', r"unknown key 'endpont'"),
    ('{"publisher": "zmq",', r"not valid JSON"),
    ('["zmq"]', r"expected a JSON object"),
])
def test_an_unparsable_config_names_the_key(raw: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_kv_events_config(raw)
