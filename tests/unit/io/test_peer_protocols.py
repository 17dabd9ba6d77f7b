"""`PeerProtocols`, the `auto` detection's states, with a hand-driven clock and probe pool (no
sockets, no threads): only an answer decides a peer; a miss (no answer, or an answer from
neither protocol) answers the callers that waited for it and leaves the peer undecided for the
next one; a caller waits for a running probe, never past the bound; a decision lasts until the
peer is dropped. Then a hypothesis state machine over many peers checks the same rules after
every step."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from decode_worker.io.kv.peer_protocols import Mode, PeerProtocol, PeerProtocols, Probed
from decode_worker.io.kv.sglang.bootstrap_client import Probe
from decode_worker.io.kv.sglang.server_info import PrefillServerInfo
from tests.examples import examples

TIMEOUT_S = 1.0
INFO = PrefillServerInfo(2, 1, 1, 1, 16, "auto", True)
ANSWERS = {"sglang": Probe("sglang", INFO), "native": Probe("native"),
           "unreachable": Probe("unreachable", detail="h:1: [Errno 111] Connection refused"),
           "foreign": Probe("foreign", detail="answers HTTP but not as an SGLang bootstrap "
                            "server: 404")}


class FakePool(Executor):
    """Keeps every submitted probe's future; the test finishes them (as `timed` would)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[tuple[Any, ...], Future[Probed]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        job: Future[Probed] = Future()
        self.jobs.append((args, job))
        return job

    def running(self, port: int) -> list[Future[Probed]]:  # args: (probe, clock, host, port, t)
        return [job for args, job in self.jobs if args[3] == port and not job.done()]


class Rig:
    def __init__(self, mode: Mode = "auto") -> None:
        self.now = 100.0
        self.pool = FakePool()
        self.protocols = PeerProtocols(mode, _no_probe, self.pool, TIMEOUT_S, lambda: self.now)

    def get(self, port: int, since: float | None = None) -> PeerProtocol | None:
        return self.protocols.get("h", port, since)

    def answer(self, port: int, outcome: str) -> None:
        (job,) = self.pool.running(port)
        job.set_result(Probed(ANSWERS[outcome], self.now))  # it ends now


def _no_probe(host: str, port: int, timeout_s: float) -> Probe:
    raise AssertionError("the fake pool never runs a probe")


def test_an_unreachable_peer_fails_its_waiters_and_the_next_request_probes_again() -> None:
    r = Rig()
    assert r.get(1, 100.0) is None and len(r.pool.running(1)) == 1
    r.now = 100.1
    assert r.get(1, 100.1) is None and len(r.pool.jobs) == 1  # waits for the running probe
    r.answer(1, "unreachable")
    r.now = 100.2
    for since in (100.0, 100.1):  # both waited for that probe: both get its miss
        proto = r.get(1, since)
        assert proto is not None and proto.kind == "unavailable" and proto.reason == "peer_dead"
        assert proto.detail == "prefill peer h:1 is unreachable: [Errno 111] Connection refused"
    assert r.protocols.known("h:1") is None and r.protocols.counts() == {"native": 0, "sglang": 0}
    r.now = 100.3
    assert r.get(1, 100.3) is None and len(r.pool.running(1)) == 1  # a later request probes
    r.answer(1, "sglang")
    proto = r.get(1, 100.3)
    assert proto == PeerProtocol("sglang", 16, 2)
    assert r.get(1, 100.0) == proto  # decided: whenever the caller began waiting


def test_a_miss_that_ended_before_a_request_came_is_not_its_answer() -> None:
    """Issue 25: a cancel's probe is refused while the peer is down; the peer restarts; a
    request arrives before the owner looked at that probe: it probes again, and is served."""
    r = Rig()
    assert r.get(8, 100.0) is None  # a cancel's probe
    r.now = 100.001
    r.answer(8, "unreachable")  # refused at once: the peer is still down
    r.now = 100.5  # the peer is up again; a request arrives
    assert r.get(8, 100.5) is None and len(r.pool.running(8)) == 1  # not failed: a new probe
    old = r.get(8, 100.0)  # the cancel that waited for the first probe gets its miss
    assert old is not None and old.kind == "unavailable"
    r.answer(8, "sglang")
    assert r.get(8, 100.5) == PeerProtocol("sglang", 16, 2)


def test_a_refusal_reported_late_is_not_the_answer_of_a_request_that_came_after_it() -> None:
    """A probe that began while the peer was down is refused at once, but its thread reports
    it late (a loaded host): a request that arrived meanwhile, after the peer listened again,
    probes again and is served (a full loaded run once failed it peer_dead). A silent peer's
    miss still answers whoever waited through the silence."""
    r = Rig()
    assert r.get(8, 100.0) is None  # a pending cancel's probe, while the peer is down
    refused = Probe("unreachable", detail="h:8: [Errno 111] Connection refused", instant=True)
    r.now = 100.5  # the peer is up again; a request arrives, waits for the running probe
    assert r.get(8, 100.4) is None and len(r.pool.jobs) == 1
    (job,) = r.pool.running(8)
    job.set_result(Probed(refused, ended_at=100.5, started_at=100.0))  # refused at 100.0+
    assert r.get(8, 100.4) is None and len(r.pool.running(8)) == 1  # not failed: a new probe
    old = r.get(8, 100.0)  # the cancel that waited since the probe began gets the refusal
    assert old is not None and old.kind == "unavailable"
    r.answer(8, "native")
    assert r.get(8, 100.4) == PeerProtocol("native")

    r.now = 200.0
    assert r.get(9, 200.0) is None
    r.now = 202.0  # silent until its timeout: the peer was silent all that while
    (job,) = r.pool.running(9)
    silent = Probe("unreachable", detail="h:9: timed out")
    job.set_result(Probed(silent, ended_at=202.0, started_at=200.0))
    miss = r.get(9, 201.0)
    assert miss is not None and miss.kind == "unavailable" and "timed out" in miss.detail


def test_probe_says_a_refusal_is_instant_and_timed_stamps_its_start() -> None:
    from decode_worker.daemon.shared.procs import free_port
    from decode_worker.io.kv.peer_protocols import timed
    from decode_worker.io.kv.sglang.bootstrap_client import probe

    ticks = iter([10.0, 11.0])
    done = timed(probe, lambda: next(ticks), "127.0.0.1", free_port(), 1.0)  # nobody listens
    assert done.found.kind == "unreachable" and done.found.instant
    assert (done.started_at, done.ended_at, done.seen_at) == (10.0, 11.0, 10.0)


def test_a_foreign_answer_decides_nothing_and_ends_requests_with_transfer_failed() -> None:
    r = Rig()
    r.get(2, 100.0)
    r.answer(2, "foreign")
    proto = r.get(2, 100.0)
    assert proto is not None and (proto.kind, proto.reason) == ("unavailable", "transfer_failed")
    assert "404" in proto.detail and r.protocols.known("h:2") is None


def test_a_native_answer_is_foreign_when_the_setting_says_sglang() -> None:
    r = Rig("sglang")
    r.get(3, 100.0)
    r.answer(3, "native")
    proto = r.get(3, 100.0)
    assert proto is not None and proto.reason == "transfer_failed"
    assert "transfer.peer_protocol is 'sglang'" in proto.detail


def test_a_caller_waits_for_a_running_probe_at_most_the_bound() -> None:
    r = Rig()
    assert r.get(4, 100.0) is None
    r.now = 100.0 + r.protocols.wait_limit_s
    assert r.get(4, 100.0) is None
    r.now += 0.01
    proto = r.get(4, 100.0)
    assert proto is not None and proto.kind == "unavailable" and "did not answer" in proto.detail
    assert len(r.pool.jobs) == 1  # the probe still runs: a later caller waits for it
    assert r.get(4, r.now) is None


def test_a_decision_is_kept_until_the_peer_is_dropped() -> None:
    r = Rig()
    r.get(5, 100.0)
    r.answer(5, "native")
    assert r.get(5) == PeerProtocol("native")
    r.now = 500.0
    assert r.get(5, 500.0) == PeerProtocol("native") and len(r.pool.jobs) == 1
    r.protocols.forget("h:5", "connection closed (the prefill peer exited or restarted)")
    assert r.protocols.known("h:5") is None
    lost = r.protocols.last_miss("h:5")  # what a request admitted before the drop ends with
    assert lost is not None and lost.reason == "peer_dead" and "exited or restarted" in lost.detail
    assert r.get(5, 499.0) == lost  # a caller from before the drop (a cancel): no new probe
    assert r.get(5, 500.1) is None and len(r.pool.running(5)) == 1  # a new request probes


def test_native_mode_never_probes_nor_forgets() -> None:
    r = Rig("native")
    assert r.get(6, 100.0) == PeerProtocol("native") and r.pool.jobs == []
    r.protocols.forget("h:6", "connection closed")
    assert r.protocols.known("h:6") == PeerProtocol("native")  # what a submit then goes to
    assert r.protocols.counts() == {"native": 1, "sglang": 0}
    lost = r.get(6, 99.0)  # a caller from before the drop (a cancel) holds: no connection now
    assert lost is not None and lost.kind == "unavailable" and "connection closed" in lost.detail
    r.now = 100.5
    assert r.get(6, 100.1) == PeerProtocol("native") and r.pool.jobs == []  # a later one


def test_a_probe_that_raises_is_a_miss() -> None:
    r = Rig()
    r.get(7, 100.0)
    (job,) = r.pool.running(7)
    job.set_exception(ValueError("bad host"))
    proto = r.get(7, 100.0)
    assert proto is not None and proto.kind == "unavailable" and "bad host" in proto.detail


class _Detection(RuleBasedStateMachine):
    """Many peers; requests arrive, probes answer, time passes, receivers drop peers."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig()
        self.last_answer: dict[int, str] = {}  # port -> outcome of its last finished probe
        self.missed_at: dict[int, float] = {}  # port -> when a miss (or a drop) was taken
        self.taken: set[int] = set()  # ids of the finished probes `get` has seen
        self.answered_at: dict[int, float] = {}  # port -> when its last probe ended

    @rule(port=st.integers(1, 3), back=st.sampled_from([0.0, 0.05, 0.5, 3.0]))
    def ask(self, port: int, back: float) -> None:
        since = self.rig.now - back
        running_before = bool(self.rig.pool.running(port))
        fresh = [job for args, job in self.rig.pool.jobs
                 if args[3] == port and job.done() and id(job) not in self.taken]
        if fresh and self.last_answer.get(port) in ("unreachable", "foreign"):
            self.missed_at[port] = self.answered_at[port]  # this call takes that miss
        proto = self.rig.get(port, since)
        self.taken |= {id(job) for job in fresh}
        if proto is None:
            assert self.rig.pool.running(port), "None only while a probe runs"
        elif proto.kind in ("native", "sglang"):
            assert self.last_answer.get(port) == proto.kind, "decided only by that answer"
        else:
            waited_out = running_before and self.rig.now - since > self.rig.protocols.wait_limit_s
            assert waited_out or self.missed_at.get(port, -1.0) >= since, (
                "a miss goes only to callers that waited for it")

    @rule(port=st.integers(1, 3), outcome=st.sampled_from(sorted(ANSWERS)))
    def probe_answers(self, port: int, outcome: str) -> None:
        for job in self.rig.pool.running(port):  # an ignored one (dropped peer) may answer too
            job.set_result(Probed(ANSWERS[outcome], self.rig.now))
            self.last_answer[port] = outcome
            self.answered_at[port] = self.rig.now

    @rule(dt=st.sampled_from([0.01, 0.3, 2.5]))
    def time_passes(self, dt: float) -> None:
        self.rig.now += dt

    @rule(port=st.integers(1, 3))
    def receiver_drops(self, port: int) -> None:
        self.rig.protocols.forget(f"h:{port}", "no heartbeat answer for 2.0 s")
        self.missed_at[port] = self.rig.now
        self.last_answer.pop(port, None)
        self.taken |= {id(job) for args, job in self.rig.pool.jobs if args[3] == port}  # ignored

    @invariant()
    def one_probe_per_peer_and_decisions_only_from_answers(self) -> None:
        for port in (1, 2, 3):
            assert len(self.rig.pool.running(port)) <= 1
            known = self.rig.protocols.known(f"h:{port}")
            assert known is None or known.kind == self.last_answer.get(port)


_Detection.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40,
                                        deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
TestDetection = _Detection.TestCase


@pytest.mark.parametrize("outcome", ["unreachable", "foreign"])
def test_a_miss_never_decides(outcome: str) -> None:
    r = Rig()
    for i in range(3):
        r.now = 100.0 + i
        assert r.get(9, r.now) is None
        r.answer(9, outcome)
        proto = r.get(9, r.now)
        assert proto is not None and proto.kind == "unavailable"
    assert r.protocols.known("h:9") is None and len(r.pool.jobs) == 3
