"""SIGTERM of a decode worker under P/D load (a real prefill peer beside it): every request
accepted before the signal gets tokens or an error answer (none is cut off silently, none is
left hanging), whatever stage it is in (waiting for KV, decoding, streaming or not), and the
worker exits 0 within the drain grace."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.procs import http_json
from scripts.soak_lib.client import Answer, post
from tests.e2e.driver import Workers

pytestmark = pytest.mark.slow
GRACE_S = 3.0
SYSTEM = [random.Random(3).randrange(3, 250) for _ in range(100)]


@pytest.fixture
def workers(e2e_model_dir: Path) -> Iterator[Workers]:
    extra = ["--set", f"server.drain_grace_s={GRACE_S}", "--set", "scheduler.kv_timeout_s=60",
             "--set", "cache.num_full_pages=512", "--set", "cache.num_swa_pages=128"]
    with Workers(e2e_model_dir, router=False, extra=extra) as w:
        yield w


def _body(w: Workers, ids: list[int], max_new: int, stream: bool, pd: bool,
          orphan: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "stream": stream, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    if pd or orphan:
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=w.boot_port,
                    bootstrap_room=random.getrandbits(63))
    return body


def _submit(pool: ThreadPoolExecutor, w: Workers, body: dict[str, Any],
            orphan: bool) -> Future[Answer]:
    """The decode half; for P/D (not an orphan room) the prefill half too, in the background."""
    if body.get("bootstrap_room") is not None and not orphan:
        pool.submit(post, f"{w.prefill.url}/generate", body, 30.0)
    return pool.submit(post, f"{w.decode.url}/generate", body, 30.0)


def _num_reqs(w: Workers) -> int:
    load = http_json(f"{w.decode.url}/get_load", timeout_s=5)[0]
    return int(load["num_reqs"])


def test_sigterm_under_pd_load_answers_every_accepted_request(workers: Workers) -> None:
    w = workers
    plan = ([("long-pd", _body(w, [*SYSTEM, i], 3000, i % 2 == 0, pd=True)) for i in range(4)]
            + [("short-pd", _body(w, [*SYSTEM[:60], i], 8, i % 2 == 1, pd=True))
               for i in range(4)]
            + [("long-local", _body(w, [*SYSTEM[:30], i], 3000, i == 0, pd=False))
               for i in range(2)]
            + [("orphan", _body(w, [*SYSTEM[:50], i], 4, i == 0, pd=False, orphan=True))
               for i in range(2)])
    with ThreadPoolExecutor(len(plan) * 2) as pool:
        futures = [(kind, _submit(pool, w, body, kind == "orphan")) for kind, body in plan]
        deadline = time.monotonic() + 60
        shorts = [f for kind, f in futures if kind == "short-pd"]
        # the ones that cannot finish are in, and the short ones were accepted (under load one
        # may still be on its way: SIGTERM would refuse it, rightly, with a drain 503)
        while ((_num_reqs(w) < 8 or not all(f.done() for f in shorts))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert _num_reqs(w) >= 8, "the long requests and orphans never all got in"
        assert w.decode.proc is not None
        signalled = time.monotonic()
        w.decode.proc.send_signal(signal.SIGTERM)
        rc = w.decode.proc.wait(GRACE_S + 15)
        took = time.monotonic() - signalled
        answers = [(kind, f.result(timeout=30)) for kind, f in futures]
    silent = [(kind, a) for kind, a in answers if a.kind not in ("tokens", "error")]
    assert not silent, f"accepted before SIGTERM, never answered: {silent}"
    assert rc == 0, w.decode.output()[-3000:]
    assert took <= GRACE_S + 5, f"exit took {took:.1f}s with a grace of {GRACE_S}s"
    by_kind: dict[str, list[Answer]] = {}
    for kind, a in answers:
        by_kind.setdefault(kind, []).append(a)
    assert all(a.kind == "error" and "drain" in a.detail for a in by_kind["orphan"]), by_kind
    # the long ones cannot finish within the grace: they end with a drain error, after tokens
    assert all(a.kind == "error" and "drain" in a.detail for a in by_kind["long-pd"]), by_kind
    assert any(a.num_tokens > 0 for a in by_kind["long-pd"] + by_kind["long-local"]), by_kind
    assert all(a.kind == "tokens" for a in by_kind["short-pd"]), by_kind["short-pd"]
