"""The soak's faults. Each injects one fault while the traffic runs and returns whether the
system survived it: the decode worker healthy afterwards and a probe request answered with
tokens (after a restart, once the restarted process is ready), plus what the fault itself
must show (a clear 4xx for bad bodies, an answer for each request it made, the drain contract).
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import zmq

from decode_worker.io.kv import protocol as p
from scripts.soak_lib import grpc_door
from scripts.soak_lib.client import post
from scripts.soak_lib.cluster import DRAIN_GRACE_S, Cluster, health_ok, value
from scripts.soak_lib.rogue import RoguePeer
from scripts.soak_lib.traffic import SYSTEM, Requester, State, Tally, gen_body

COUNTERS = ("evicted_pages", "retractions", "aborts", "transfer_failures", "transfer_bad_frames",
            "host_hit_tokens", "host_restored_tokens", "host_write_failures",
            "host_restore_failures", "host_evicted_pages", "spec_verify_steps",
            "spec_proposed_tokens", "spec_accepted_tokens")
GRPC_OK = "grpc_generate_ok"  # `carried` key: the gRPC Generate calls a stopped worker answered


@dataclass
class Chaos:
    cluster: Cluster
    state: State
    tally: Tally
    req: Requester
    rng: random.Random
    notes: list[str] = field(default_factory=list)
    carried: dict[str, float] = field(default_factory=dict)  # counters of stopped workers

    def probe(self, pd: bool, within_s: float = 30.0) -> bool:
        """A request answered with tokens within `within_s` (retried: peers may be rejoining)."""
        deadline, got = time.monotonic() + within_s, ""
        while time.monotonic() < deadline:
            body = gen_body([*SYSTEM[:40], self.rng.randrange(3, 250)], 3, stream=False)
            got = self.req.pd(body, self.rng) if pd else self.req.local("/generate", body)
            if got == "tokens":
                return True
            time.sleep(0.5)
        self.notes.append(f"{self.state.phase}: no {'P/D' if pd else 'local'} probe answered "
                          f"with tokens in {within_s:g}s (last: {got}: {self._last_detail(pd)})")
        return False

    def _last_detail(self, pd: bool) -> str:
        ans = self.req.last if pd else None
        return f"{ans.status} {ans.detail[:160]!r}" if ans is not None else "-"

    def carry_counters(self) -> None:
        scrape = self.cluster.decode_metrics()
        for name in COUNTERS:
            self.carried[name] = self.carried.get(name, 0.0) + value(scrape, name)
        self.carried[GRPC_OK] = self.carried.get(GRPC_OK, 0.0) + value(
            scrape, "grpc_requests", method="Generate", code="OK")


def prefill_sigkill(c: Chaos) -> bool:
    proc = c.cluster.prefill.proc
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    time.sleep(c.rng.uniform(0.5, 2.0))  # traffic meets the dead peer meanwhile
    c.cluster.restart_prefill()
    return health_ok(c.cluster.decode_url) and c.probe(pd=True)


def prefill_sigstop(c: Chaos) -> bool:
    proc = c.cluster.prefill.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    time.sleep(c.rng.uniform(0.5, 3.0))
    proc.send_signal(signal.SIGCONT)
    return health_ok(c.cluster.decode_url) and c.probe(pd=True)


def client_disconnect(c: Chaos) -> bool:
    """Streams hung up after their first event; the worker counts client aborts."""
    before = value(c.cluster.decode_metrics(), "aborts", reason="client_abort")
    for i in range(3):
        body = json.dumps(gen_body(SYSTEM[: 30 + i], 300, stream=True)).encode()
        with socket.create_connection(("127.0.0.1", c.cluster.decode_port), timeout=30) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while b"data:" not in got and (chunk := s.recv(4096)):
                got += chunk
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if value(c.cluster.decode_metrics(), "aborts", reason="client_abort") >= before + 3:
            return c.probe(pd=False)
        time.sleep(0.2)
    c.notes.append("client_disconnect: the worker did not count 3 client aborts in 10 s")
    return False


def _bad_bodies(rng: random.Random) -> list[bytes]:
    good = json.dumps(gen_body(SYSTEM[:20], 4, stream=False)).encode()
    return [rng.randbytes(rng.randrange(1, 200)), good[: rng.randrange(1, len(good))],
            b'{"input_ids": [1, 1000000]}', b'{"input_ids": "abc"}', b"[]", b"null",
            b'{"sampling_params": {"max_new_tokens": -1}, "input_ids": [1]}',
            b'{"text": "x", "sampling_params": {"temperature": "hot"}}',
            b'{"input_ids": [1], "bootstrap_port": 70000, "bootstrap_host": "x"}',
            b'{"messages": 5}', b'{"prompt": {"a": 1}}']


def malformed_http(c: Chaos) -> bool:
    """Broken bodies on every generation route of both servers: each a clear 4xx; and bad
    gRPC Generate requests to both: each INVALID_ARGUMENT."""
    ok = _malformed_grpc(c)
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        for raw in _bad_bodies(c.rng):
            ans = post(f"{c.cluster.decode_url}{path}", raw, 10.0)
            verdict = c.tally.record(c.state.phase, "decode", ans)
            if verdict != "error" or ans.status is None or not 400 <= ans.status < 500:
                c.notes.append(f"malformed_http: {path} {raw[:60]!r} -> {ans.kind} {ans.status}")
                ok = False
            post(f"{c.cluster.prefill_url}{path}", raw, 10.0)  # the peer must survive it too
    return ok and health_ok(c.cluster.prefill_url) and c.probe(pd=True)


def _malformed_grpc(c: Chaos) -> bool:
    if c.cluster.decode_grpc is None or c.cluster.prefill_grpc is None:
        return True
    bad = [grpc_door.request([], 4, False), grpc_door.request([1, 10**6], 4, True),
           grpc_door.request(SYSTEM[:20], 4, False), grpc_door.request(SYSTEM[:9], 10**7, False)]
    bad[2].sampling_params.top_p = 7.0
    ok = True
    for req in bad:
        for target in (c.cluster.decode_grpc, c.cluster.prefill_grpc):
            ans = grpc_door.generate(target, req, 10.0)
            if target == c.cluster.decode_grpc:
                c.tally.record(c.state.phase, "decode", ans, door="grpc")
            if ans.kind != "error" or ans.status != grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                c.notes.append(f"malformed_http: gRPC {target} -> {ans.kind} {ans.detail[:80]}")
                ok = False
    return ok


def malformed_frames(c: Chaos) -> bool:
    """Garbage to the prefill peer's bootstrap socket, and non-HTTP bytes to the worker."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{c.cluster.boot_port}")
        compat = p.ModelCompat("x", "float32", ["full"], 1, 1, 16, 1)
        for msg in (c.rng.randbytes(64), b"", p.encode(p.Ping(1))[:-1],
                    p.encode(p.Hello(99, compat, "soak", b"", [])),
                    p.encode(p.TransferDone(1, 2, 3, 4)), p.encode(p.Abort(5, 6))):
            sock.send(msg)
        sock.send_multipart([b"a", b"b", b"c"])
        sock.poll(500)
    finally:
        ctx.destroy(0)
    for junk in (c.rng.randbytes(300), b"\x16\x03\x01\x02\x00" + c.rng.randbytes(40),
                 b"GET / HTTP/9.9\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", c.cluster.decode_port), timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.recv(4096)
    return health_ok(c.cluster.decode_url) and c.probe(pd=True)


def dup_late_completions(c: Chaos) -> bool:
    """Requests whose peer sends duplicate, unknown and late completions: each answered."""
    with RoguePeer() as rogue:
        verdicts = [c.req.pd(gen_body([*SYSTEM[:60], i + 3], 4, stream=i % 2 == 1), c.rng,
                             boot_port=rogue.port, with_prefill=False) for i in range(2)]
        time.sleep(2.0)  # the late messages arrive after the requests ended
    if rogue.requests == 0:
        c.notes.append("dup_late_completions: the rogue peer saw no transfer request")
    return all(v in ("tokens", "error") for v in verdicts) and c.probe(pd=False)


def pool_pressure(c: Chaos) -> bool:
    """A burst far past the tiny pools, all admitted at once (no growth reserve): long unrelated
    prompts (the tree evicts) and short prompts that grow long (decode retracts); every one
    answered."""
    bodies = [gen_body([c.rng.randrange(3, 250) for _ in range(c.rng.randrange(150, 400))],
                       c.rng.randrange(20, 60), stream=i % 2 == 0) for i in range(4)]
    bodies += [gen_body([c.rng.randrange(3, 250) for _ in range(40)], 160, stream=i % 2 == 0)
               for i in range(10)]
    before = c.cluster.decode_metrics()
    with ThreadPoolExecutor(len(bodies)) as pool:
        verdicts = list(pool.map(lambda b: c.req.local("/generate", b), bodies))
    after = c.cluster.decode_metrics()
    moved = {n: value(after, n) - value(before, n) for n in ("evicted_pages", "retractions")}
    if not any(moved.values()):
        c.notes.append(f"pool_pressure: neither eviction nor retraction happened ({moved})")
    return all(v in ("tokens", "error") for v in verdicts) and c.probe(pd=False)


def decode_sigterm(c: Chaos) -> bool:
    """SIGTERM under load: drain (answers out within the grace), exit 0, restart."""
    c.carry_counters()
    proc = c.cluster.decode.proc
    assert proc is not None
    c.state.stop_begins("decode")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(DRAIN_GRACE_S + 15)
    except Exception:
        proc.kill()
        rc = proc.wait(10)
    took = time.monotonic() - t0
    c.cluster.decode.stop()  # closes its log
    c.cluster.restart_decode()
    c.state.stop_ends("decode")
    ok = rc == 0 and took <= DRAIN_GRACE_S + 5
    if not ok:
        c.notes.append(f"decode_sigterm: exit {rc} after {took:.1f}s (grace {DRAIN_GRACE_S}s)")
    return ok and c.probe(pd=True)


FAULTS: dict[str, Callable[[Chaos], bool]] = {
    "prefill_sigkill": prefill_sigkill, "prefill_sigstop": prefill_sigstop,
    "client_disconnect": client_disconnect, "malformed_http": malformed_http,
    "malformed_frames": malformed_frames, "dup_late_completions": dup_late_completions,
    "pool_pressure": pool_pressure, "decode_sigterm": decode_sigterm,
}


RESTARTS = ("decode_sigterm", "prefill_sigkill")  # the slow ones: a process starts again
RESTART_NEEDS_S = 12.0  # a restart fault starts only with this much of the run left


def deck(rng: random.Random, kinds: list[str]) -> list[str]:
    """`kinds` once each, as a stack to pop: the quick ones first in a random order, then
    the restarts in RESTARTS order (so that a short run still meets every quick kind)."""
    quick = [k for k in kinds if k not in RESTARTS]
    rng.shuffle(quick)
    return (quick + [k for k in RESTARTS if k in kinds])[::-1]
