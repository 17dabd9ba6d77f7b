"""Failures on the transfer path fail only their request: the decode worker keeps serving and
its pools come back to their earlier counts."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_worker.daemon.shared.procs import http_json, scrape_metric
from decode_worker.errors import DecodeWorkerError
from tests.e2e.driver import Workers

pytestmark = pytest.mark.slow
KV_TIMEOUT_S = 3.0


@pytest.fixture
def workers(e2e_model_dir: Path) -> Iterator[Workers]:
    extra = ["--set", f"scheduler.kv_timeout_s={KV_TIMEOUT_S}",
             "--set", "transfer.peer_dead_after_s=2", "--set", "transfer.abort_quiesce_s=2",
             "--set", "cache.num_full_pages=256", "--set", "cache.num_swa_pages=64"]
    with Workers(e2e_model_dir, router=False, extra=extra) as w:
        yield w


def _decode_only(w: Workers, prompt: list[int]) -> tuple[float, str]:
    """A decode request naming a room the prefill peer never hears of over HTTP."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": w.boot_port,
            "bootstrap_room": random.getrandbits(63)}
    t0 = time.monotonic()
    with pytest.raises(DecodeWorkerError) as info:
        http_json(f"{w.decode.url}/generate", body, timeout_s=60)
    return time.monotonic() - t0, str(info.value)


def _used_pages(w: Workers) -> tuple[float, float]:
    url = w.decode.url
    return (scrape_metric(url, "decode_worker_kv_pages_used", 'pool="full"')
            - scrape_metric(url, "decode_worker_kv_pages_evictable", 'pool="full"'),
            scrape_metric(url, "decode_worker_kv_pages_used", 'pool="swa"')
            - scrape_metric(url, "decode_worker_kv_pages_evictable", 'pool="swa"'))


def _wait_pages(w: Workers, want: tuple[float, float], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _used_pages(w) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _used_pages(w) == want


def test_orphan_room_times_out_frees_pages_and_worker_keeps_serving(workers: Workers) -> None:
    w = workers
    base = _used_pages(w)
    took, message = _decode_only(w, [random.randrange(3, 250) for _ in range(100)])
    assert took < KV_TIMEOUT_S + 10, f"answered after {took:.1f}s"
    assert "kv_timeout" in message or "504" in message, message
    _wait_pages(w, base, 15)
    assert scrape_metric(w.decode.url, "decode_worker_transfer_failures_total") >= 1
    ok = http_json(f"{w.decode.url}/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0}})
    assert len(ok["output_ids"]) == 2


def test_dead_prefill_peer_fails_the_request_within_seconds(workers: Workers) -> None:
    w = workers
    base = _used_pages(w)
    assert w.prefill.proc is not None
    w.prefill.proc.send_signal(signal.SIGKILL)
    w.prefill.proc.wait(10)
    took, message = _decode_only(w, [random.randrange(3, 250) for _ in range(100)])
    assert took < 30, f"answered after {took:.1f}s"
    assert any(r in message for r in ("peer_dead", "transfer_failed", "kv_timeout")), message
    _wait_pages(w, base, 15)
    http_json(f"{w.decode.url}/health")  # still up and healthy (raises on a non-2xx)
