"""Peer protocols as the request table applies them: a request waits (PEER) until its peer's
protocol is known, then is queued (an SGLang prefill's page size set on it) or ended with a
reason that names what to change (an unreachable peer: peer_dead at once, counted); a request
that ends while it waits leaves at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest
from decode_worker.daemon.decode.fetcher import AuxBuffers, KVFetcher
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.daemon.decode.parking import Wait
from decode_worker.daemon.decode.requests import RequestTable
from decode_worker.io.kv.router import PeerProtocol


class FakeRouter:
    """Answers `protocol_of` from a dict (None: still probing); records each caller's `since`
    and the failures counted; no transfer is ever in flight."""

    def __init__(self, answers: dict[int, PeerProtocol | None]) -> None:
        self.answers = answers
        self.since: dict[int, float | None] = {}
        self.failures: list[str] = []

    def protocol_of(self, host: str, port: int, since: float | None = None) -> PeerProtocol | None:
        self.since[port] = since
        return self.answers[port]

    def count_failure(self, reason: str) -> None:
        self.failures.append(reason)

    def take_events(self) -> list[object]:
        return []  # no transfer in flight

    def cancel_room(self, host: str, port: int, room: int, reason: str, detail: str) -> None:
        pass


class FakeQueue:
    """The prealloc queue (these requests join it at an admission pass, which these tests
    never run: they read the table's `arrivals`)."""

    def abort_request(self, rid: str, now: float, reason: str, message: str = "") -> None:
        return None


def table(answers: dict[int, PeerProtocol | None], *, radix: bool = True) -> RequestTable:
    """A request table whose peers answer `answers` (a fetcher over `FakeRouter`); no batch."""
    kv_ctx: Any = SimpleNamespace(page_size=16, radix_cache=radix)
    router = FakeRouter(answers)
    aux: Any = AuxBuffers(SimpleNamespace(num_rows=4), None)  # type: ignore[arg-type]
    f = KVFetcher(router, aux, kv_ctx, None, None)  # type: ignore[arg-type]
    batch: Any = SimpleNamespace(leave=lambda live: 0, steps_done=0)
    outbox: Any = SimpleNamespace(put=lambda event: None)
    return RequestTable(kv_ctx, FakeQueue(), None, router, f, outbox, batch)  # type: ignore[arg-type]


def live(t: RequestTable, port: int) -> LiveRequest:
    cmd = AddRequest(f"r{port}", [1, 2, 3], SamplingParams(max_new_tokens=4), False,
                     "127.0.0.1", port, 7, 0.0)
    return t.register(cmd)


def waiting(t: RequestTable, *ports: int) -> list[LiveRequest]:
    lives = [live(t, port) for port in ports]
    for i, lv in enumerate(lives):
        t.wait_for_peer(lv, 100.0 + i)
    return lives


def queued(t: RequestTable) -> list[str]:
    """The requests that join the prealloc queue at this step's pass."""
    return [lv.rid for lv in t.arrivals]


def peers(t: RequestTable) -> list[str]:
    return [rec.live.rid for rec in t.parked.at(Wait.PEER)]


def test_waiting_requests_are_queued_once_their_peer_is_known() -> None:
    t = table({1: None, 2: PeerProtocol("native"), 3: PeerProtocol("sglang", 16, 2)})
    r1, r2, r3 = waiting(t, 1, 2, 3)
    t.poll(200.0)
    assert queued(t) == ["r2", "r3"]
    assert r2.req.sglang_page_size == 0 and r3.req.sglang_page_size == 16
    assert peers(t) == ["r1"] and r1.parked is not None  # still probing
    router = t.fetcher.receiver
    assert router.since == {1: 100.0, 2: 101.0, 3: 102.0}  # type: ignore[attr-defined]
    t.poll(201.0)
    assert router.since[1] == 100.0  # type: ignore[attr-defined]  # it keeps its start


@pytest.mark.parametrize(("page", "radix", "words"), [
    (12, False, "does not divide the decode page size 16"),
    (8, True, "with the decode radix cache on"),
])
def test_an_sglang_page_size_we_cannot_take_ends_the_request_naming_the_fix(
        page: int, radix: bool, words: str) -> None:
    t = table({5: PeerProtocol("sglang", page, 1)}, radix=radix)
    (lv,) = waiting(t, 5)
    t.poll(200.0)
    assert lv.ended is not None and lv.ended.reason == "transfer_failed"
    why = lv.ended.message
    assert words in why and "--page-size" in why and "cache.page_size" in why
    assert not t.parked and t.requests_total["failed"] == 1


def test_a_smaller_prefill_page_is_taken_without_the_radix_cache() -> None:
    t = table({6: PeerProtocol("sglang", 8, 1)}, radix=False)
    (lv,) = waiting(t, 6)
    t.poll(200.0)
    assert lv.ended is None and lv.req.sglang_page_size == 8
    assert queued(t) == ["r6"]


def test_an_unavailable_peer_ends_its_request_at_once_and_ended_requests_leave() -> None:
    """Unreachable: peer_dead with the probe's words, counted with the transfer failures (as
    its transfer would have been); an answer from neither protocol: transfer_failed. A request
    that ends while it waits leaves the lot at once (its peer is never asked again)."""
    t = table({7: PeerProtocol("unavailable", detail="prefill peer 127.0.0.1:7 is "
                               "unreachable: connection refused"),
               9: PeerProtocol("unavailable", detail="answers HTTP 404",
                               reason="transfer_failed"), 8: None})
    r7, gone, r9 = waiting(t, 7, 8, 9)
    t.end(gone, "client_abort", "aborted: client_abort", 150.0)
    assert gone.parked is None and peers(t) == ["r7", "r9"]
    t.poll(200.0)
    assert r7.ended is not None and r9.ended is not None
    assert (r7.ended.reason, r7.ended.message) == (
        "peer_dead", "prefill peer 127.0.0.1:7 is unreachable: connection refused")
    assert (r9.ended.reason, r9.ended.message) == ("transfer_failed", "answers HTTP 404")
    router = t.fetcher.receiver
    assert router.failures == ["peer_dead", "transfer_failed"]  # type: ignore[attr-defined]
    assert not t.parked and 8 not in router.since  # type: ignore[attr-defined]


class _Restoring:
    """A restore still copying (the request waits for it, gated)."""

    def is_done(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("not waited here")


def test_an_admission_reports_its_host_hits_as_part_of_cached_tokens() -> None:
    """`cached_tokens` is the admission's prefix; its host part is the restored pages' tokens.
    A readmission with less reuse keeps the better pair."""
    from decode_worker.core.admission import Admit
    from decode_worker.core.host_tier import HostRestore

    t = table({})
    cmd = AddRequest("r", list(range(64)), SamplingParams(max_new_tokens=4), False, None, None,
                     None, 0.0)
    lv = t.register(cmd)
    lv.restore = _Restoring()
    # 48 tokens reused: 1 page on the device, 2 pages (32 tokens) restored from the host
    t.fetch(lv, Admit(lv.req, 48, 48, [10, 11, 12, 13], [], HostRestore([5, 6], [10, 11])), 0.0)
    assert (lv.cached_tokens, lv.host_cached_tokens) == (48, 32)
    assert [r.live for r in t.parked.at(Wait.RESTORE)] == [lv]  # it waits for its restore
    for args in ((16, 1.0), (64, 2.0)):  # readmitted with less reuse, then with more
        t.parked.move(lv.parked, None)  # type: ignore[arg-type]  # (as if readmitted)
        t.fetch(lv, Admit(lv.req, args[0], 48, [20, 21, 22], []), args[1])
        want = (48, 32) if args[0] == 16 else (64, 0)
        assert (lv.cached_tokens, lv.host_cached_tokens) == want
