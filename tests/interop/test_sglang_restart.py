"""A stock SGLang prefill restarted behind the same address serves the next request.

The prefill is SGLang 0.5.23's own prefill classes (tests/interop/sglang_prefill/, under the
SGLang venv; the test skips without it), killed with SIGKILL and started again on the same
ports. Two real `decode-worker serve`s feed from it, one with `transfer.peer_protocol=auto`,
one with `=sglang`. Checked for each: the first request sent once the restarted prefill is
healthy succeeds, token-exact against transformers (tokens, logprobs, top logprobs); a request
sent while it is down fails at once (502 peer_dead, "unreachable", under 1 s); the worker ends
idle with every page back.

Regression (issue 25): a request in flight when the prefill died failed as it should, but the
worker's cancel of that room probed the bootstrap address while the server was being killed;
the dying socket's reset was taken for "not HTTP", i.e. a native peer, so the first request
after the restart went to the native receiver and failed after peer_dead_after_s ("no
handshake answer"). Prints, per worker, the time from the restarted prefill's health to its
first successful answer. Ports 18600-18699.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from decode_worker.daemon.shared.procs import ServerProcess
from decode_worker.device.default_model import write_model
from tests.e2e.live_fixtures import Live
from tests.interop.pd import (
    PAGE_SIZE,
    PYTHON,
    assert_idle_and_whole,
    check_against_reference,
    conversation,
    needs_sglang_venv,
    pd_body,
    pd_request,
    worker_args,
)
from tests.interop.sglang_peer import TERMINAL, HarnessPorts, SglangPrefill
from tests.waiting import timed_unreachable_answer

pytestmark = [pytest.mark.slow, needs_sglang_venv]

PORTS = HarnessPorts(18600, 18601, "18610-18619", "18620-18639")
WORKERS = {"auto": (18690, "18640-18659"), "sglang": (18691, "18660-18679")}  # port, UCX
DOWN_ANSWER_S = 1.0  # a request to a prefill that is down is answered within this


@dataclass
class Rig:
    model_dir: Path
    harness: SglangPrefill
    workers: dict[str, Live]  # by transfer.peer_protocol
    reference: Any  # transformers' GptOssForCausalLM, float32

    def start_harness(self) -> float:
        """(Re)start the prefill on the same ports; returns when it answered /health."""
        assert PYTHON is not None
        self.harness = SglangPrefill(PYTHON, PORTS, ["--model", str(self.model_dir),
                                                     "--page-size", str(PAGE_SIZE)]).start()
        return self.harness.wait_healthy()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    transformers = pytest.importorskip("transformers")
    model_dir = write_model(tmp_path_factory.mktemp("sglang-restart") / "tiny-gpt-oss", seed=0)
    procs = {name: ServerProcess(f"decode-{name}", worker_args(model_dir, port, name), port,
                                 env={"UCX_TCP_PORT_RANGE": ucx})
             for name, (port, ucx) in WORKERS.items()}  # fmt: skip
    rig = Rig(model_dir, None, {}, None)  # type: ignore[arg-type]
    try:
        for proc in procs.values():
            proc.__enter__()
        rig.start_harness()
        ref = transformers.GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        rig.reference = ref.eval()
        for name, proc in procs.items():
            proc.wait_ready(120)
            rig.workers[name] = Live(proc)
        yield rig
    finally:
        for live in rig.workers.values():
            live.close()
        if rig.harness is not None:
            rig.harness.kill()
        for proc in procs.values():
            proc.stop()


def served(rig: Rig, worker: Live, prompt: list[int]) -> float:
    """One P/D request: served, token-exact; returns when its answer came (before the check)."""
    resp, state = pd_request(rig.harness, worker, prompt)
    answered_at = time.monotonic()
    assert resp.status_code == 200, resp.text[:2000]
    assert state["status"] == "success", f"prefill side {state}"
    check_against_reference(rig.reference, prompt, resp.json())
    return answered_at


def served_after_restart(rig: Rig, prompt: list[int], health_at: float, label: str) -> None:
    """Each worker's first request once the prefill is healthy (one after the other)."""
    for name, worker in rig.workers.items():
        sent = time.monotonic()
        answered_at = served(rig, worker, prompt)
        print(f"\n[{label}] peer_protocol={name}: first success {answered_at - health_at:.3f} s "
              f"after the restarted SGLang prefill's health (the request itself "
              f"{answered_at - sent:.3f} s)")


def test_the_first_request_after_a_restart_is_served(rig: Rig) -> None:
    """Killed with a room of each worker in flight (the worker's TransferInfo reached it);
    those fail peer_dead; restarted: the next request of each worker is served."""
    prompt = conversation(seed=21, turns=1)[0]
    for name, worker in rig.workers.items():  # each worker knows the peer and registered
        served(rig, worker, prompt)
        sent = time.monotonic()
        took = served(rig, worker, conversation(seed=20, turns=1)[0]) - sent
        print(f"\n[steady] peer_protocol={name}: a request {took:.3f} s")
    with ThreadPoolExecutor(max_workers=len(rig.workers)) as pool:
        in_flight = [_start_stuck_room(rig, worker, prompt, pool)
                     for worker in rig.workers.values()]
        killed_at = time.monotonic()
        rig.harness.kill()
        for answer in in_flight:
            resp = answer.result(timeout=30)
            assert resp.status_code == 502 and "peer_dead" in resp.text, resp.text[:2000]
    assert time.monotonic() - killed_at < 5.0
    health_at = rig.start_harness()
    served_after_restart(rig, prompt, health_at, "killed under traffic")
    for worker in rig.workers.values():
        assert_idle_and_whole(worker)


def test_a_request_while_the_prefill_is_down_fails_at_once_then_the_restart_serves(
        rig: Rig) -> None:
    prompt = conversation(seed=22, turns=1)[0]
    rig.harness.kill()
    time.sleep(0.2)  # the workers see their rank connections drop
    for name, worker in rig.workers.items():
        for _ in range(2):  # the second probes again: still no answer, still at once
            body = pd_body(rig.harness, prompt, random.getrandbits(63))
            timed_unreachable_answer(
                lambda b=body, w=worker: w.post("/generate", b, timeout_s=30), name,
                DOWN_ANSWER_S)
    health_at = rig.start_harness()
    served_after_restart(rig, prompt, health_at, "down, then restarted")
    for worker in rig.workers.values():
        assert_idle_and_whole(worker)


def _start_stuck_room(rig: Rig, worker: Live, prompt: list[int],
                      pool: ThreadPoolExecutor) -> Future[httpx.Response]:
    """A room whose prefill "forward" lasts a minute: the worker's request waits on it, its
    TransferInfo already at the prefill (waiting_for_input) when this returns."""
    room = random.getrandbits(63)
    rig.harness.prefill({"room": room, "input_ids": prompt, "kv": "model", "delay_s": 60,
                         "timeout_s": 90})
    answer = pool.submit(worker.post, "/generate", pd_body(rig.harness, prompt, room),
                         timeout_s=40)
    state = rig.harness.wait_room(room, ("waiting_for_input", *TERMINAL), 20)
    assert state["status"] == "waiting_for_input", state
    return answer
