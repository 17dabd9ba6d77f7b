"""The soak's traffic: multi-turn conversations (P/D through the decode worker and the prefill
peer, through the router when there is one, and local prefill), streaming or not, from a few
threads; and the tally of every request by the fault that was active when it started, and by
the door it went through (`http`, `grpc`). A `grpc_share` of the turns goes over smg's gRPC
worker protocol (`grpc_door.py`) instead of HTTP: P/D (the prefill half to the peer's gRPC
port) or local prefill, as smg in gRPC mode sends them.

Deciding what counts as answered (`Tally.record`): tokens and error answers do; a stream cut
without `[DONE]` and a request past its deadline never do. A refused connection (never
accepted: the client learns at once) counts as an error answer when it was refused while that
server was being stopped on purpose; a dropped one (accepted, then broken before a status)
only when the request was sent after the stop began. A request accepted before a deliberate
SIGTERM that then loses its connection breaks the drain contract and counts as never
answered, as does any refused or dropped connection at other times.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from scripts.soak_lib import grpc_door
from scripts.soak_lib.client import Answer, post
from scripts.soak_lib.cluster import Cluster

NO_FAULT = "traffic"
SYSTEM = [random.Random(7).randrange(3, 250) for _ in range(150)]  # shared first turn prefix
MAX_PROMPT = 640


@dataclass
class State:
    """What the fault thread tells the traffic: the active fault, deliberate stop windows."""

    phase: str = NO_FAULT
    stops: dict[str, list[list[float]]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop_begins(self, target: str) -> None:
        with self.lock:
            self.stops[target].append([time.monotonic(), float("inf")])

    def stop_ends(self, target: str) -> None:
        with self.lock:
            self.stops[target][-1][1] = time.monotonic()

    def refusal_is_answer(self, target: str, at: float) -> bool:
        """True when `at` falls while `target` was being stopped on purpose."""
        with self.lock:
            return any(begin <= at <= end for begin, end in self.stops[target])


class Tally:
    """Per phase: requests sent, answered with tokens, with an error, never answered."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.rows: dict[str, Counter[str]] = defaultdict(Counter)
        self.doors: dict[str, Counter[str]] = defaultdict(Counter)  # http / grpc
        self.lost: list[tuple[str, str, Answer]] = []
        self._lock = threading.Lock()

    def record(self, phase: str, target: str, ans: Answer, door: str = "http") -> str:
        """Count `ans` in `phase`'s and `door`'s rows; returns the verdict (tokens / error /
        unanswered)."""
        verdict = ans.kind
        if verdict in ("refused", "dropped"):
            at = ans.ended_at if verdict == "refused" else ans.started_at
            verdict = "error" if self.state.refusal_is_answer(target, at) else "unanswered"
        elif verdict in ("cut", "malformed", "timeout", "crashed"):
            verdict = "unanswered"
        with self._lock:
            self.rows[phase]["sent"] += 1
            self.rows[phase][verdict] += 1
            self.doors[door]["sent"] += 1
            self.doors[door][verdict] += 1
            if verdict == "unanswered":
                self.lost.append((phase, target, ans))
        return verdict

    def totals(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for row in self.rows.values():
            out.update(row)
        return out


def gen_body(ids: list[int], max_new: int, stream: bool) -> dict[str, Any]:
    return {"input_ids": ids, "stream": stream, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


class Requester:
    """Sends one user request the way a router would, and tallies its answer."""

    def __init__(self, cluster: Cluster, state: State, tally: Tally) -> None:
        self.cluster, self.state, self.tally = cluster, state, tally
        self._side = ThreadPoolExecutor(8, thread_name_prefix="soak-prefill-half")
        self._mine = threading.local()  # per thread: the last answer `pd` got (`last`)

    def pd(self, body: dict[str, Any], rng: random.Random, boot_port: int | None = None,
           with_prefill: bool = True) -> str:
        """P/D straight to both servers: the prefill half in the background (its answer is
        not the user's), the decode half counted."""
        phase = self.state.phase
        body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_room": rng.getrandbits(63),
                "bootstrap_port": boot_port or self.cluster.boot_port}
        side = (self._side.submit(post, f"{self.cluster.prefill_url}/generate", body, 30.0)
                if with_prefill else None)
        ans = post(f"{self.cluster.decode_url}/generate", body)
        if side is not None:
            with contextlib.suppress(Exception):
                side.result(timeout=40)
        self._mine.last = ans
        return self.tally.record(phase, "decode", ans)

    @property
    def last(self) -> Answer | None:
        """The last answer `pd` got in this thread (a probe's note says what it was)."""
        return getattr(self._mine, "last", None)

    def local(self, path: str, body: dict[str, Any]) -> str:
        phase = self.state.phase
        return self.tally.record(phase, "decode", post(f"{self.cluster.decode_url}{path}", body))

    def via_router(self, body: dict[str, Any]) -> str:
        phase, url = self.state.phase, self.cluster.router_url
        assert url is not None
        return self.tally.record(phase, "router", post(f"{url}/generate", body, 70.0))

    def grpc(self, body: dict[str, Any], rng: random.Random, pd: bool) -> str:
        """`body` (a /generate body) as a gRPC Generate to the decode worker: P/D (the prefill
        half to the peer's gRPC port in the background) or local prefill."""
        phase, cluster = self.state.phase, self.cluster
        assert cluster.decode_grpc is not None and cluster.prefill_grpc is not None
        boot = (cluster.boot_port, rng.getrandbits(31)) if pd else None
        req = grpc_door.request(body["input_ids"], body["sampling_params"]["max_new_tokens"],
                                body["stream"], boot)
        side = (self._side.submit(grpc_door.generate, cluster.prefill_grpc, req, 30.0)
                if pd else None)
        ans = grpc_door.generate(cluster.decode_grpc, req)
        if side is not None:
            with contextlib.suppress(Exception):
                side.result(timeout=40)
        return self.tally.record(phase, "decode", ans, door="grpc")

    def close(self) -> None:
        self._side.shutdown(wait=False, cancel_futures=True)


class Traffic:
    """`threads` conversation loops until `stop` is set; `grpc_share` of the turns over gRPC
    (0 when the cluster serves no gRPC)."""

    def __init__(self, req: Requester, seed: int, threads: int, grpc_share: float = 0.0) -> None:
        self.req = req
        self.grpc_share = grpc_share if req.cluster.decode_grpc is not None else 0.0
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(seed * 1000 + i,),
                                          name=f"soak-traffic-{i}", daemon=True)
                         for i in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout_s: float) -> bool:
        """Stop and wait; False if a thread still runs after `timeout_s`."""
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            try:
                self._conversation(rng)
            except Exception as exc:  # the harness's own failure: a loss, never a quiet thread
                self.req.tally.record(self.req.state.phase, "soak", Answer(
                    "crashed", None, f"traffic thread: {exc!r}"[:300], time.monotonic()))

    def _conversation(self, rng: random.Random) -> None:
        history = list(SYSTEM)
        for _ in range(rng.randint(2, 4)):
            prompt = history + [rng.randrange(3, 250) for _ in range(rng.randrange(8, 60))]
            if self.stop.is_set() or len(prompt) > MAX_PROMPT:
                return
            body = gen_body(prompt, rng.randrange(2, 40), stream=rng.random() < 0.5)
            self._send(body, rng)
            history = prompt + [rng.randrange(3, 250) for _ in range(rng.randrange(2, 20))]

    def _send(self, body: dict[str, Any], rng: random.Random) -> None:
        if rng.random() < self.grpc_share:
            self.req.grpc(body, rng, pd=rng.random() < 0.7)
            return
        roll = rng.random()
        if roll < 0.2 and self.req.cluster.router_url is not None:
            self.req.via_router(body)
        elif roll < 0.75:
            self.req.pd(body, rng)
        elif roll < 0.9:
            self.req.local("/generate", body)
        else:
            chat = {"messages": [{"role": "user", "content": "soak " * rng.randrange(1, 30)}],
                    "max_tokens": rng.randrange(2, 20), "stream": body["stream"]}
            self.req.local("/v1/chat/completions", chat)
