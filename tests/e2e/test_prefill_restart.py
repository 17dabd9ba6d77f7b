"""A prefill peer SIGKILLed under traffic and restarted on the same ports serves P/D again.

Regression: while the peer was down the decode worker's protocol router failed requests itself
("prefill peer unreachable"), so its transfer ids ran ahead of the native receiver's, and the
first-token check compared the aux row (written under the id the peer was sent) with the
router's id: every later P/D request failed with "first token missing" until a restart."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from decode_worker.daemon.shared.procs import ServerProcess
from scripts.soak_lib.client import Answer, post
from tests.e2e.driver import Workers

pytestmark = pytest.mark.slow


@pytest.fixture
def workers(e2e_model_dir: Path) -> Iterator[Workers]:
    extra = ["--set", "transfer.peer_dead_after_s=2", "--set", "transfer.abort_quiesce_s=2",
             "--set", "cache.num_full_pages=256", "--set", "cache.num_swa_pages=64"]
    with Workers(e2e_model_dir, router=False, extra=extra) as w:
        yield w


def _pd(w: Workers, pool: ThreadPoolExecutor) -> Answer:
    body = {"input_ids": list(range(3, 90)), "sampling_params": {
        "max_new_tokens": 3, "temperature": 0}, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": w.boot_port, "bootstrap_room": random.getrandbits(63)}
    pool.submit(post, f"{w.prefill.url}/generate", body, 20.0)
    return post(f"{w.decode.url}/generate", body, 30.0)


def test_pd_works_again_after_the_prefill_peer_restarts(workers: Workers) -> None:
    w = workers
    with ThreadPoolExecutor(4) as pool:
        assert _pd(w, pool).kind == "tokens"
        assert w.prefill.proc is not None
        w.prefill.proc.send_signal(signal.SIGKILL)
        w.prefill.proc.wait(10)
        down = [_pd(w, pool) for _ in range(3)]  # answered by the worker: the peer is gone
        assert all(a.kind == "error" and a.status == 502 for a in down), down
        w.prefill.stop()
        w.prefill = ServerProcess("prefill", w.prefill.args, w.prefill_port)
        w.prefill.__enter__()
        w.prefill.wait_ready(120)
        deadline = time.monotonic() + 20  # the worker learns the restarted peer's protocol
        answers = [_pd(w, pool)]
        while answers[-1].kind != "tokens" and time.monotonic() < deadline:
            time.sleep(0.5)
            answers.append(_pd(w, pool))
        after = [_pd(w, pool) for _ in range(3)]
    assert answers[-1].kind == "tokens", answers
    assert all(a.kind == "tokens" for a in after), after
