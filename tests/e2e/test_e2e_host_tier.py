"""Faults of the host tier against real processes, seen by the client over HTTP.

A decode worker whose device pool (32 pages) is smaller than the conversations, with a prefill
peer: a restore that fails (the test fault point `fail_restores`, armed through
`DW_TEST_FAULTS`) ends that request alone with a 500 naming `restore_failed` while a request
beside it is answered; a client that leaves, and a prefill peer that dies, while a request's host
hits are restored and it waits for the rest of its KV lose nothing. The copy itself is made in
the admission step (the engine waits for it today), so "during a restore" is the span from
admission (host pages locked, the restore's device pages allocated) to the request running.
After each: every device page is free or cached, no host page is locked, and the worker keeps
serving. A second worker with a host pool too small for its conversations skips (and counts) the
writes it cannot make and answers every turn as the reference does.

The P/D tests share one worker and run in file order: the module's first restore is the one
that fails; the last test kills the prefill peer.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.decode.faults import ENV
from decode_worker.daemon.shared.procs import http_json
from decode_worker.errors import DecodeWorkerError
from tests.e2e.driver import Workers, get_text
from tests.e2e.live_fixtures import Metrics, gen_body, live_server, pool_is_whole

pytestmark = pytest.mark.slow
MAX_NEW = 6
TIGHT = ["--set", "cache.num_full_pages=32", "--set", "scheduler.integrity_check_interval_s=0.1"]
Reference = Callable[[list[int], int], tuple[list[int], list[float]]]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def pd(e2e_model_dir: Path) -> Iterator[Workers]:
    decode = [*TIGHT, "--set", "scheduler.kv_timeout_s=10", "--set",
              "transfer.peer_dead_after_s=2", "--set", "transfer.abort_quiesce_s=2"]
    w = Workers(e2e_model_dir, router=False, extra=[], decode_extra=decode)
    w.decode.env[ENV] = "fail_restores=1"  # the first restore fails, the later ones work
    with w:
        yield w


def _metrics(w: Workers) -> Metrics:
    return Metrics(get_text(f"{w.decode.url}/metrics"))


def _wait_whole(w: Workers, timeout_s: float = 20.0) -> Metrics:
    """The worker's metrics once nothing is queued, every device page is free or cached and no
    host page is locked (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(w)
        busy = m.value("decode_worker_queue_requests")
        problems = pool_is_whole(m) + ([f"host: {m.pool('host')}"]
                                       if m.pool("host")["protected"] else [])
        if not busy and not problems:
            return m
        assert time.monotonic() < deadline, f"not whole: busy={busy} {problems}"
        time.sleep(0.1)


def _pd_turn(w: Workers, prompt: list[int]) -> dict[str, Any]:
    """Prefill and decode halves of one room, as a router sends them; the decode's answer
    (raises DecodeWorkerError with its status and body on an error)."""
    body = gen_body(prompt, MAX_NEW, bootstrap_host="127.0.0.1", bootstrap_port=w.boot_port,
                    bootstrap_room=random.getrandbits(63))
    with ThreadPoolExecutor(1) as pool:
        pre = pool.submit(http_json, f"{w.prefill.url}/generate", body)
        try:
            return dict(http_json(f"{w.decode.url}/generate", body))
        finally:
            with contextlib.suppress(DecodeWorkerError):  # the decode ended the room first
                pre.result(timeout=30)


def _demote(w: Workers, rng: random.Random) -> None:
    """Two long unrelated prompts: what was cached before is evicted from the 32-page device
    pool (to the host tier, where it was written through)."""
    for _ in range(2):
        _pd_turn(w, _tokens(rng, 300))


def _host_hits(w: Workers) -> float:
    return _metrics(w).value("decode_worker_prefix_cache_host_hit_tokens_total")


def _assert_host_split(meta: dict[str, Any]) -> None:
    """A turn with host hits reports them in SGLang's split of `cached_tokens`."""
    details = meta["cached_tokens_details"]
    assert details["host"] > 0, meta
    assert details["device"] + details["host"] == meta["cached_tokens"], meta


def _orphan_body(w: Workers, prompt: list[int]) -> dict[str, Any]:
    """A decode half for a room the prefill peer never hears of: it waits for its KV."""
    return gen_body(prompt, MAX_NEW, bootstrap_host="127.0.0.1", bootstrap_port=w.boot_port,
                    bootstrap_room=random.getrandbits(63))


def _wait_restored_and_waiting(w: Workers, hits_before: float, timeout_s: float = 10.0) -> None:
    """Until the request's host hits were restored and it waits for its transfer."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(w)
        if (m.value("decode_worker_prefix_cache_host_hit_tokens_total") > hits_before
                and m.value("decode_worker_queue_requests", queue="transfer") == 1):
            return
        assert time.monotonic() < deadline, "the request did not restore and wait for its KV"
        time.sleep(0.05)


def test_a_failing_restore_ends_that_request_alone_and_the_next_is_served(
        pd: Workers, reference_greedy: Reference) -> None:
    rng = random.Random(1)
    first = _tokens(rng, 170)
    out = _pd_turn(pd, first)
    _demote(pd, rng)
    again = first + out["output_ids"] + _tokens(rng, 20)
    other = _tokens(rng, 120)  # no host hit: no restore
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(_pd_turn, pd, other)
        with pytest.raises(DecodeWorkerError) as failed:
            _pd_turn(pd, again)
        assert beside.result(timeout=60)["output_ids"] == reference_greedy(other, MAX_NEW)[0]
    message = str(failed.value)
    assert "HTTP 500" in message and "restore_failed" in message, message
    m = _wait_whole(pd)
    assert m.value("decode_worker_kv_host_restore_failures_total") == 1
    assert m.value("decode_worker_requests_total", status="failed") == 1
    # the host copy is intact: the same prompt now restores it and answers as the reference
    hits = m.value("decode_worker_prefix_cache_host_hit_tokens_total")
    out = _pd_turn(pd, again)
    assert out["output_ids"] == reference_greedy(again, MAX_NEW)[0]
    assert out["meta_info"]["cached_tokens"] >= 160
    _assert_host_split(out["meta_info"])
    assert _host_hits(pd) > hits
    _wait_whole(pd)


def test_a_client_leaving_during_a_restore_loses_nothing(
        pd: Workers, reference_greedy: Reference) -> None:
    rng = random.Random(2)
    first = _tokens(rng, 170)
    out = _pd_turn(pd, first)
    _demote(pd, rng)
    again = first + out["output_ids"] + _tokens(rng, 20)
    aborts = _metrics(pd).value("decode_worker_aborts_total", reason="client_abort")
    hits = _host_hits(pd)
    payload = json.dumps(_orphan_body(pd, again)).encode()
    with socket.create_connection(("127.0.0.1", pd.decode_port), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        _wait_restored_and_waiting(pd, hits)
    m = _wait_whole(pd)
    assert m.value("decode_worker_aborts_total", reason="client_abort") == aborts + 1
    out = _pd_turn(pd, again)  # the host copy is still there and restores
    assert out["output_ids"] == reference_greedy(again, MAX_NEW)[0]
    _wait_whole(pd)


def test_a_prefill_dying_during_a_restore_loses_nothing(
        pd: Workers, reference_greedy: Reference) -> None:
    """Last in this module: it kills the prefill peer."""
    rng = random.Random(3)
    first = _tokens(rng, 170)
    out = _pd_turn(pd, first)
    _demote(pd, rng)
    again = first + out["output_ids"] + _tokens(rng, 20)
    hits = _host_hits(pd)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(http_json, f"{pd.decode.url}/generate", _orphan_body(pd, again))
        _wait_restored_and_waiting(pd, hits)
        assert pd.prefill.proc is not None
        pd.prefill.proc.send_signal(signal.SIGKILL)
        pd.prefill.proc.wait(10)
        with pytest.raises(DecodeWorkerError) as failed:
            answer.result(timeout=30)
    assert "HTTP 502" in str(failed.value) and "peer_dead" in str(failed.value), failed.value
    _wait_whole(pd)
    # still serving, and the host copy still restores (prefilled here: the peer is gone)
    local = http_json(f"{pd.decode.url}/generate", gen_body(again, MAX_NEW))
    assert local["output_ids"] == reference_greedy(again, MAX_NEW)[0]
    assert local["meta_info"]["cached_tokens"] >= 160
    _assert_host_split(local["meta_info"])
    _wait_whole(pd)


def test_a_full_host_pool_skips_writes_and_every_answer_is_right(
        e2e_model_dir: Path, reference_greedy: Reference) -> None:
    """16 host pages (hicache_ratio 0.5 of 32): a chat's 10-page prefix fits, a second one's
    write finds the host pool held by prefixes still on the device and is skipped."""
    rng = random.Random(4)
    chats = [_tokens(rng, 160) for _ in range(3)]
    with live_server(e2e_model_dir, *TIGHT, "--set", "cache.hicache_ratio=0.5") as live:
        for turn in range(3):
            for c, prompt in enumerate(chats):
                resp = live.post("/generate", gen_body(prompt, MAX_NEW))
                assert resp.status_code == 200, resp.text
                out = resp.json()
                assert out["output_ids"] == reference_greedy(prompt, MAX_NEW)[0], (c, turn)
                chats[c] = prompt + out["output_ids"] + _tokens(rng, 20)
        m = live.wait_idle()
        assert m.value("decode_worker_kv_host_write_failures_total") > 0
        assert m.value("decode_worker_kv_host_written_bytes_total") > 0
        assert m.pool("host")["total"] == 16 and m.pool("host")["protected"] == 0
        assert not pool_is_whole(m), pool_is_whole(m)
        assert live.get("/health").status_code == 200
