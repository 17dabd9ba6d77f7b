"""A reference prefill peer (`decode-worker prefill`) SIGKILLed and restarted on the same ports
serves the first P/D request sent once it is healthy again, token-exact against transformers,
for a decode worker with `transfer.peer_protocol=auto` and one with `=native`; a request sent
while it is down fails at once (502 peer_dead, "unreachable", under 1 s).

Regressions: while the peer was down the protocol router failed requests itself, so its
transfer ids ran ahead of the native receiver's and the first-token check compared the aux row
(written under the id the peer was sent) with the router's id: every later request failed with
"first token missing". Issue 25: the native receiver noticed a dead peer only by its missing
heartbeats, so a request sent while the peer was down waited `peer_dead_after_s`, and one sent
to a peer restarted within that time went to a process that never had our handshake. Prints,
per worker, the time from the restarted peer's health to its first successful answer.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from decode_worker.daemon.shared.procs import ServerProcess
from tests.e2e.driver import Workers, wait_idle
from tests.waiting import timed_unreachable_answer

pytestmark = pytest.mark.slow
MAX_NEW = 4
DOWN_ANSWER_S = 1.0  # a request to a prefill peer that is down is answered within this
# peer_dead_after_s well past every bound below: a dead peer is seen by its closed or refused
# connection, not by its missing heartbeats
SETS = {"transfer.peer_dead_after_s": 10, "transfer.abort_quiesce_s": 2,
        "cache.num_full_pages": 256, "cache.num_swa_pages": 64}


@dataclass
class Cluster:
    w: Workers  # the prefill peer and the `auto` decode worker
    decodes: dict[str, ServerProcess]  # by transfer.peer_protocol
    http: httpx.Client

    def restart_prefill(self) -> float:
        """Start the prefill peer again on its ports; returns when it answered /health."""
        old = self.w.prefill
        old.stop()
        self.w.prefill = old.again()
        self.w.prefill.__enter__()
        return wait_health(self.http, self.w.prefill, 120.0)


@pytest.fixture(scope="module")
def cluster(e2e_model_dir: Path) -> Iterator[Cluster]:
    extra = [x for key, value in SETS.items() for x in ("--set", f"{key}={value}")]
    with Workers(e2e_model_dir, router=False, extra=extra) as w:
        native = ServerProcess("decode-native", [
            "serve", "--port", "0", "--model", str(e2e_model_dir), "--set",
            "cache.page_size=16", *extra, "--set", "transfer.peer_protocol=native"])
        with native, httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0)) as http:
            native.wait_ready(120)
            yield Cluster(w, {"auto": w.decode, "native": native}, http)


def body_of(c: Cluster, prompt: list[int]) -> dict[str, Any]:
    return {"input_ids": prompt, "return_logprob": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": c.w.boot_port, "bootstrap_room": random.getrandbits(63),
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}


def pd(c: Cluster, decode: ServerProcess, prompt: list[int]) -> httpx.Response:
    """The router's part: the same body to the prefill peer and to the decode worker."""
    body = body_of(c, prompt)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pre = pool.submit(c.http.post, f"{c.w.prefill.url}/generate", json=body)
        resp = c.http.post(f"{decode.url}/generate", json=body)
        pre.result(timeout=30)
    return resp


def served(c: Cluster, decode: ServerProcess, prompt: list[int],
           reference: Callable[[list[int], int], Any]) -> float:
    """One P/D request: served, token-exact; returns when its answer came (before the check)."""
    resp = pd(c, decode, prompt)
    answered_at = time.monotonic()
    assert resp.status_code == 200, resp.text[:2000]
    out = resp.json()
    want, lp_rows = reference(prompt, MAX_NEW)
    assert out["output_ids"] == want, "tokens differ from the reference"
    got = out["meta_info"]["output_token_logprobs"]
    worst = max(abs(lp - float(rows[t])) for (lp, t, _), rows in zip(got, lp_rows, strict=True))
    assert worst < 1e-4, f"logprobs off by {worst:.2e}"
    return answered_at


def served_after_restart(c: Cluster, prompt: list[int], health_at: float,
                         reference: Callable[[list[int], int], Any], label: str) -> None:
    """Each worker's first request once the peer is healthy (one after the other)."""
    for name, decode in c.decodes.items():
        sent = time.monotonic()
        answered_at = served(c, decode, prompt, reference)
        print(f"\n[{label}] peer_protocol={name}: first success {answered_at - health_at:.3f} s "
              f"after the restarted prefill peer's health (the request itself "
              f"{answered_at - sent:.3f} s)")
        wait_idle(decode.url, 15)


def test_the_first_request_after_a_restart_is_served(cluster: Cluster,
                                                     reference_run: Any) -> None:
    """Killed with a transfer of each worker in flight (its request reached the peer, whose
    prompt never comes): those fail peer_dead; restarted: the next request is served."""
    c, prompt = cluster, prompt_of(1)
    for name, decode in c.decodes.items():
        served(c, decode, prompt, reference_run)
        sent = time.monotonic()
        took = served(c, decode, prompt_of(0), reference_run) - sent
        print(f"\n[steady] peer_protocol={name}: a request {took:.3f} s")
    with ThreadPoolExecutor(max_workers=len(c.decodes)) as pool:
        stuck: list[Future[httpx.Response]] = [
            pool.submit(c.http.post, f"{d.url}/generate", json=body_of(c, prompt_of(2)))
            for d in c.decodes.values()]
        time.sleep(0.5)  # their transfer requests wait at the peer for the prompt
        assert c.w.prefill.proc is not None
        c.w.prefill.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for answer in stuck:
            resp = answer.result(timeout=30)
            assert resp.status_code == 502 and "peer_dead" in resp.text, resp.text[:2000]
    assert time.monotonic() - killed_at < DOWN_ANSWER_S  # the connection closed: at once
    served_after_restart(c, prompt_of(3), c.restart_prefill(), reference_run, "killed")


def test_a_request_while_the_peer_is_down_fails_at_once_then_the_restart_serves(
        cluster: Cluster, reference_run: Any) -> None:
    c = cluster
    assert c.w.prefill.proc is not None
    c.w.prefill.proc.send_signal(signal.SIGKILL)
    c.w.prefill.proc.wait(10)
    time.sleep(0.2)  # the workers see their connections to it close
    for name, decode in c.decodes.items():
        for i in range(3):  # each probes again (auto) or connects again (native): no answer
            body = body_of(c, prompt_of(4 + i))
            timed_unreachable_answer(
                lambda b=body, d=decode: c.http.post(f"{d.url}/generate", json=b), name,
                DOWN_ANSWER_S)
    served_after_restart(c, prompt_of(8), c.restart_prefill(), reference_run, "down")


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(rng.randrange(80, 200))]


def wait_health(http: httpx.Client, proc: ServerProcess, timeout_s: float) -> float:
    """Poll GET /health every 10 ms; `time.monotonic()` of the first 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.proc is not None and proc.proc.poll() is None, proc.output()[-3000:]
        try:
            if http.get(f"{proc.url}/health", timeout=1.0).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"{proc.name} not healthy in {timeout_s} s:\n{proc.output()[-3000:]}")
