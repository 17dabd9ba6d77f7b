"""Issue 14, the transfer part, against a real prefill peer process (real ZMQ, NIXL over UCX,
HTTP): a decode-side refusal or abort reaches the prefill peer, which answers the router's copy
of the request at once with the decode side's reason; a SIGKILLed peer is found dead in under
3 s with the default settings; the optional KV checksum fails a corrupted transfer."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest, Ended, Event, Outbox
from decode_worker.daemon.prefill.main import build_runner
from decode_worker.daemon.prefill.state import Matcher, PrefillResult
from decode_worker.daemon.shared.compat import model_compat, region_layouts
from decode_worker.daemon.shared.procs import free_port
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.runner import ModelRunner
from decode_worker.device.sglang_aux import SglangAuxBuffers
from decode_worker.io.kv.protocol import TransferRequest
from decode_worker.io.kv.receiver import KVReceiver, TransferEvent
from decode_worker.io.kv.sglang.receiver import SglangReceiver
from decode_worker.io.metrics import Metrics
from decode_worker.settings import TransferSettings, load_settings
from decode_worker.utils.mathx import align_down, cdiv
from tests.integration.conftest import PeerLaunch, launch_prefill_peer, stop

pytestmark = pytest.mark.slow
PS = 16


@pytest.fixture(scope="module")
def peer(model_cache: Path) -> Iterator[tuple[int, int]]:
    """(bootstrap port, http port) of a prefill peer that waits 30 s for a room's other half."""
    launch = launch_prefill_peer(model_cache, "--set", "scheduler.kv_timeout_s=30")
    yield launch.port, launch.http_port
    stop(launch.proc)


@pytest.fixture(scope="module")
def runner(model_cache: Path) -> ModelRunner:
    s = load_settings(overrides={"model.cache_dir": str(model_cache), "cache.num_full_pages": 64,
                                 "cache.num_swa_pages": 64}, environ={}).settings  # fmt: skip
    runner, name, _ = build_runner(s)
    runner.model_name = name  # type: ignore[attr-defined]  # for `receiver`
    return runner


def receiver(runner: ModelRunner, aux: AuxBuffer, **settings: Any) -> KVReceiver:
    name = runner.model_name  # type: ignore[attr-defined]
    return KVReceiver(TransferSettings(**settings), model_compat(runner, name),
                      region_layouts(runner.pools, aux))  # fmt: skip


class Posted:
    """POST /generate to the prefill peer, in a thread: `result()` joins it and gives (the
    response, the monotonic time it came)."""

    def __init__(self, hport: int, bport: int, room: int, ids: list[int]) -> None:
        self.out: list[tuple[httpx.Response, float]] = []
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8},
                "bootstrap_room": room, "bootstrap_host": "127.0.0.1", "bootstrap_port": bport}

        def run() -> None:
            r = httpx.post(f"http://127.0.0.1:{hport}/generate", json=body, timeout=40.0)
            self.out.append((r, time.monotonic()))

        self._thread = threading.Thread(target=run)
        self._thread.start()

    def done(self) -> bool:
        return bool(self.out)

    def result(self, timeout_s: float = 40.0) -> tuple[httpx.Response, float]:
        self._thread.join(timeout_s)
        assert self.out, "the prefill peer did not answer"
        return self.out[0]


def metric(hport: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{hport}/metrics", timeout=10.0).text
    rows = [ln for ln in text.splitlines() if ln.startswith(name)]
    return float(rows[0].split()[-1]) if rows else 0.0


class EngineRun:
    """A decode engine on the cached tiny model (eager) with small pools, its events recorded,
    stepped from the test's thread."""

    def __init__(self, model_cache: Path, *, num_full_pages: int, num_swa_pages: int) -> None:
        from decode_worker.daemon.decode.engine import DecodeEngine

        settings = load_settings(overrides={
            "model.cache_dir": str(model_cache), "cache.num_full_pages": num_full_pages,
            "cache.num_swa_pages": num_swa_pages, "scheduler.cuda_graph": False},
            environ={}).settings  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.engine = DecodeEngine.build(settings, Metrics())
        self.events: list[Event] = []
        self.engine.outbox = Outbox(self.loop, self.events.extend)

    def ended(self) -> bool:
        return any(isinstance(e, Ended) for e in self.events)

    def step_until(self, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, what
            self.engine.step(time.monotonic())
            self.loop.run_until_complete(asyncio.sleep(0.001))

    def close(self) -> None:
        self.engine.receiver.close()
        self.loop.close()


def test_an_admission_refusal_reaches_the_prefill_peer_which_answers_within_1s(
    peer: tuple[int, int], model_cache: Path
) -> None:
    """The router's body goes to both; the decode worker refuses it (too_large: the prompt can
    never fit its pools); the prefill peer answers 413 naming that, not at its 30 s timeout."""
    bport, hport = peer
    room, prompt = 9001, [(5 * i) % 256 for i in range(300)]
    posted = Posted(hport, bport, room, prompt)
    time.sleep(0.5)  # the prompt waits at the prefill peer for its transfer request
    eng = EngineRun(model_cache, num_full_pages=8, num_swa_pages=16)
    try:
        eng.engine.inbox.put(AddRequest("big", prompt, SamplingParams(max_new_tokens=4), False,
                                        "127.0.0.1", bport, room, 0.0))  # fmt: skip
        eng.step_until(eng.ended, 20, "the decode engine did not end the request")
        refused_at = time.monotonic()
        (ended,) = [e for e in eng.events if isinstance(e, Ended)]
        assert ended.reason == "too_large"
        resp, at = posted.result()
    finally:
        eng.close()
    assert resp.status_code == 413, resp.text
    assert "too_large" in resp.text
    assert at - refused_at < 1.0


def test_a_refusal_before_the_prompt_answers_it_on_arrival_and_a_late_one_is_ignored(
    peer: tuple[int, int], runner: ModelRunner
) -> None:
    bport, hport = peer
    aux = AuxBuffer(4)  # registered with NIXL: lives as long as the receiver
    rx = receiver(runner, aux)
    try:
        late_before = metric(hport, 'decode_worker_transfer_decode_aborts_total{outcome="late"}')
        rx.cancel_room("127.0.0.1", bport, 9002, "queue_full", "the prealloc queue is full")
        time.sleep(0.3)  # the refusal is there first; no handshake was needed
        t0 = time.monotonic()
        resp, at = Posted(hport, bport, 9002, [1, 2, 3]).result()
        assert resp.status_code == 503 and "queue_full" in resp.text, resp.text
        assert at - t0 < 1.0
        rx.cancel_room("127.0.0.1", bport, 9002, "client_abort", "again")  # late: ignored
        time.sleep(0.3)
        late = metric(hport, 'decode_worker_transfer_decode_aborts_total{outcome="late"}')
        assert late == late_before + 1
        assert httpx.get(f"http://127.0.0.1:{hport}/health", timeout=5.0).status_code == 200
    finally:
        rx.close()


def submit(rx: KVReceiver, port: int, room: int, n: int, *, prompt: list[int] | None = None,
           timeout_s: float = 20.0) -> tuple[int, list[int], list[int]]:
    """A cold request of `n` tokens into pages 1.. (full) and 1.. (SWA tail)."""
    s = align_down(max(0, n - 1 - 127), PS)
    full, swa = list(range(1, cdiv(n, PS) + 1)), list(range(1, cdiv(n, PS) - s // PS + 1))
    tid = rx.submit("127.0.0.1", port, rid=f"r{room}", room=room, prompt_len=n, reused_len=0,
                    swa_window_start=s, full_page_ids=full, swa_page_ids=swa, aux_row=room % 4,
                    timeout_s=timeout_s, prompt_ids=prompt)  # fmt: skip
    return tid, full, swa


def wait_for(rx: KVReceiver, tid: int, kind: str, timeout_s: float) -> list[TransferEvent]:
    got: list[TransferEvent] = []
    deadline = time.monotonic() + timeout_s
    while not any(e.kind == kind for e in got):
        assert time.monotonic() < deadline, f"no {kind!r} for transfer {tid}: {got}"
        got += [e for e in rx.take_events() if e.transfer_id == tid]
        time.sleep(0.002)
    return got


def test_a_sigkilled_prefill_peer_is_found_dead_within_3s_by_default(
    runner: ModelRunner, model_cache: Path
) -> None:
    launch = launch_prefill_peer(model_cache)
    port, proc = launch.port, launch.proc
    aux = AuxBuffer(4)  # registered with NIXL: lives as long as the receiver
    rx = receiver(runner, aux)  # the default heartbeat settings
    try:
        tid, _, _ = submit(rx, port, 41, 200)  # waits at the peer for its prompt
        deadline = time.monotonic() + 10
        while not all(peer.ready for peer in rx._peers.values()):
            assert time.monotonic() < deadline and not rx.take_events()
            time.sleep(0.01)
        time.sleep(1.0)  # a few heartbeats answered
        assert not rx.take_events()
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        failed = wait_for(rx, tid, "failed", timeout_s=10.0)[-1]
        took = time.monotonic() - t0
        assert failed.reason == "peer_dead", failed
        assert took < 3.0, f"dead peer found after {took:.2f} s"
    finally:
        rx.close()
        stop(proc)


def test_a_kv_checksum_mismatch_fails_the_request_and_is_counted(
    peer: tuple[int, int], runner: ModelRunner
) -> None:
    bport, _ = peer
    aux = AuxBuffer(4)  # kept alive: the peer writes the first token into it
    rx = receiver(runner, aux, kv_checksum=True)
    prompt = [(3 * i) % 256 for i in range(200)]
    try:
        tid, _, _ = submit(rx, bport, 51, len(prompt), prompt=prompt)
        assert [e.kind for e in wait_for(rx, tid, "done", 20.0)] == ["done"]
        assert aux.check(51 % 4, room=51, transfer_id=tid) is not None
        assert rx.stats.kv_checksum_failures == 0
        book = rx._book
        honest = book._checksum_of
        assert honest is not None

        def corrupt_then_check(req: Any) -> int:  # between the WRITE and the check
            runner.pools.full[0, req.full_page_ids[-1]].add_(1.0)
            return honest(req)

        book._checksum_of = corrupt_then_check
        tid, _, _ = submit(rx, bport, 52, len(prompt), prompt=prompt)
        events = wait_for(rx, tid, "released", 20.0)
        assert [e.kind for e in events] == ["failed", "released"]  # pages back to the owner
        assert events[0].reason == "kv_checksum" and "mismatch" in events[0].detail
        assert rx.stats.kv_checksum_failures == 1 and rx.stats.failures["kv_checksum"] == 1
    finally:
        rx.close()


def test_a_refusal_reaches_a_prefill_peer_of_sglangs_protocol_as_abort(
    runner: ModelRunner, model_cache: Path
) -> None:
    """SGLang's ABORT carries no reason: the prefill answers with its own abort text, at once."""
    launch = launch_prefill_peer(model_cache, "--protocol", "sglang")
    bport, hport, proc = launch.port, launch.http_port, launch.proc
    aux, sg_aux = AuxBuffer(4), SglangAuxBuffers(4)
    name = runner.model_name  # type: ignore[attr-defined]
    rx = SglangReceiver(TransferSettings(), model_compat(runner, name),
                        region_layouts(runner.pools, aux),
                        [(r.addr, rb, 4) for r, rb in sg_aux.regions()])  # fmt: skip
    try:
        for room, limit_s in ((9101, 3.0), (9102, 1.0)):  # first contact registers with it
            posted = Posted(hport, bport, room, [(11 * i) % 256 for i in range(100)])
            time.sleep(0.5)
            t0 = time.monotonic()
            rx.cancel_room("127.0.0.1", bport, room, "too_large", "does not fit")
            while not posted.done() and time.monotonic() - t0 < 10.0:
                assert not rx.take_events()  # no transfer: no events
                time.sleep(0.005)
            resp, at = posted.result()
            assert resp.status_code >= 500 and "Aborted by decode-side" in resp.text, resp.text
            assert at - t0 < limit_s
    finally:
        rx.close()
        stop(proc)


def test_the_matcher_answers_a_cancelled_room_once_whatever_its_stage() -> None:
    """Waiting prompt: answered now. Running job: answered now, its own end answers nothing.
    Before the prompt: answered on arrival. Twice, or after it ran: late, ignored."""
    m = Matcher(timeout_s=5.0)
    answer = PrefillResult(1, None, 0.0, 0, "ended", error_code="client_abort")
    got: list[PrefillResult] = []
    m.add_prompt(1, [1, 2], got.append, 0.0)
    outcome, on_done = m.cancel(1, answer, 0.1)
    assert outcome == "answered" and on_done is not None and 1 not in m.prompts
    assert m.cancel(1, answer, 0.2)[0] == "late"
    req = TransferRequest(7, 2, "r", 2, 0, 0, [1], [1], 0, 5.0)
    job = m.add_request(b"peer", req, 0.0)
    assert job is None
    job = m.add_prompt(2, [1, 2], got.append, 0.0)
    assert job is not None and m.cancel(2, answer, 0.3)[0] == "answered"
    assert m.finish(job) == (False, True)  # its HTTP side was answered by the cancel
    assert m.cancel(3, answer, 0.4) == ("early", None)
    assert m.take_cancelled(3) is answer and m.take_cancelled(3) is None
    assert m.cancel(4, answer, 0.5)[0] == "early"
    m.expire(10.0)
    assert m.take_cancelled(4) is None  # forgotten after the match timeout


def test_a_request_failed_while_its_peer_was_down_is_cancelled_at_the_restarted_peer(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode worker fails a request at once while its prefill peer is down (peer_dead:
    unreachable); the peer comes back on the same port and gets the router's copy of that
    request: it answers it at once with the decode side's reason instead of holding it to its
    own timeout (30 s here). Found by scripts/soak.py (prefill_sigkill)."""
    import decode_worker.io.kv.router as router_mod

    monkeypatch.setattr(router_mod, "_CANCEL_WAIT_S", 120.0)  # however slow the peer's start
    # the peer must start on a port known before: free_port (racy, but nothing else binds
    # here in the moment between) is the only way to ask a peer that is not there yet
    bport, hport, room, prompt = free_port(), free_port(), 9101, [3, 1, 4, 1, 5, 9, 2, 6]
    eng = EngineRun(model_cache, num_full_pages=32, num_swa_pages=32)
    launch = None
    try:
        eng.engine.inbox.put(AddRequest("down", prompt, SamplingParams(max_new_tokens=4), False,
                                        "127.0.0.1", bport, room, 0.0))  # fmt: skip
        eng.step_until(eng.ended, 20, "not ended")
        (ended,) = [e for e in eng.events if isinstance(e, Ended)]
        assert ended.reason == "peer_dead", ended
        launch = PeerLaunch(bport, model_cache, "--set", "scheduler.kv_timeout_s=30",
                            http_port=hport)  # the peer (re)starts on the same port
        eng.step_until(launch._ready.is_set, 120, "the prefill peer did not start")
        t0 = time.monotonic()
        posted = Posted(hport, bport, room, prompt)  # the router's copy reaches it now
        eng.step_until(posted.done, 10, "the restarted peer held the cancelled request")
        resp, at = posted.result()
    finally:
        eng.close()
        if launch is not None:
            stop(launch.proc)
    assert resp.status_code >= 500 and "peer_dead" in resp.text, resp.text
    assert at - t0 < 5.0


def test_a_transfer_the_peer_failed_is_not_cancelled_again(
    peer: tuple[int, int], runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native peer fails a transfer itself (page ids it refuses; the decode-side check is
    skipped here to provoke it): ending the room's request afterwards (`cancel_room`, as the
    request table does on a failure, a client disconnect or a drain) tells the peer nothing,
    so it keeps its own cause. A transfer over the same connection afterwards orders the
    check: a cancel sent before it would have been counted by then."""
    import decode_worker.io.kv.receiver as kv_receiver

    bport, hport = peer
    aux = AuxBuffer(4)  # registered with NIXL: lives as long as the receiver
    rx = receiver(runner, aux)
    outcomes = ("answered", "early", "late")

    def cancels() -> float:
        return sum(metric(hport, f'decode_worker_transfer_decode_aborts_total{{outcome="{o}"}}')
                   for o in outcomes)

    try:
        before = cancels()
        with monkeypatch.context() as patch:
            patch.setattr(kv_receiver, "validate_request", lambda *args: None)
            top = runner.pools.num_pages["full"]
            tid = rx.submit("127.0.0.1", bport, rid="r9101", room=9101, prompt_len=40,
                            reused_len=0, swa_window_start=0, full_page_ids=[1, 2, top + 1],
                            swa_page_ids=[1, 2, 3], aux_row=1, prompt_ids=[7] * 40)
            events = wait_for(rx, tid, "released", 10.0)
        assert [e.kind for e in events] == ["failed", "released"]
        rx.cancel_room("127.0.0.1", bport, 9101, "transfer_failed", events[0].detail)
        prompt = [(5 * i) % 256 for i in range(64)]
        tid, _, _ = submit(rx, bport, 9102, len(prompt), prompt=prompt)
        assert [e.kind for e in wait_for(rx, tid, "done", 20.0)] == ["done"]
        assert cancels() == before
    finally:
        rx.close()
