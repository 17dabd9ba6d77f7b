"""Requests whose prefill peer's protocol is being probed (`transfer.peer_protocol=auto`) wait
for that probe, counted in the prealloc-queue gauge, at most the probe's timeout; a silent peer
(it accepts and never answers) then fails them all at once with peer_dead, and the next request
probes again. A real decode engine on the cached tiny model, stepped from the test's thread."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest, Ended
from tests.integration.test_transfer_hardening import EngineRun


@pytest.fixture
def silent_peer() -> Iterator[int]:
    """A port whose listener accepts connections (the kernel's backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as sock:
        yield sock.getsockname()[1]


def test_requests_wait_for_the_running_probe_counted_as_prealloc_then_fail_together(
        model_cache: Path, silent_peer: int) -> None:
    eng = EngineRun(model_cache, num_full_pages=32, num_swa_pages=32)
    router, books = eng.engine.receiver, eng.engine.books
    timeout_s = router.protocols.probe_timeout_s  # 1.0 s: half the default peer_dead_after_s
    gauge = books.metrics.registry.get_sample_value

    def add(rid: str, room: int) -> None:
        eng.engine.inbox.put(AddRequest(rid, [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=2),
                                        False, "127.0.0.1", silent_peer, room, 0.0))

    def ended() -> dict[str, Ended]:
        return {e.rid: e for e in eng.events if isinstance(e, Ended)}

    try:
        start = time.monotonic()
        add("first", 1)
        eng.step_until(lambda: books.queue_sizes().prealloc == 1, 5, "first not waiting")
        time.sleep(0.3)
        add("second", 2)  # arrives while the first's probe runs: waits for that probe
        eng.step_until(lambda: books.queue_sizes().prealloc == 2, 5, "second not waiting")
        eng.step_until(lambda: gauge("decode_worker_queue_requests", {"queue": "prealloc"}) == 2,
                       5, "the prealloc gauge does not count the waiting requests")
        eng.step_until(lambda: len(ended()) == 2, timeout_s + 3, "the waiters did not end")
        took = time.monotonic() - start
        for end in ended().values():
            assert end.reason == "peer_dead", end
            assert "unreachable" in end.message and "no answer within" in end.message, end
        assert timeout_s - 0.1 < took < timeout_s + 1.0, f"answered after {took:.2f} s"
        assert books.queue_sizes().prealloc == 0
        assert router.protocols.known(f"127.0.0.1:{silent_peer}") is None  # still undecided
        add("third", 3)  # the next request probes again
        eng.step_until(lambda: len(ended()) == 3, timeout_s + 3, "the third did not end")
        assert ended()["third"].reason == "peer_dead"
    finally:
        eng.close()
