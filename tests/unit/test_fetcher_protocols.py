"""The KV fetcher's side of peer protocols: a request waits until its peer's protocol is known,
then is queued (an SGLang prefill's page size set on it) or ended with a reason that names what
to change (an unreachable peer: peer_dead at once, counted); requests that ended while waiting
are dropped."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from decode_worker.core.request import DecodeRequest
from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.decode.bridge import AddRequest, Ended
from decode_worker.daemon.decode.fetcher import AuxRows, KVFetcher
from decode_worker.daemon.decode.live import LiveRequest
from decode_worker.io.kv.router import PeerProtocol


class FakeRouter:
    """Answers `protocol_of` from a dict (None: still probing); records each caller's `since`
    and the failures counted."""

    def __init__(self, answers: dict[int, PeerProtocol | None]) -> None:
        self.answers = answers
        self.since: dict[int, float | None] = {}
        self.failures: list[str] = []

    def protocol_of(self, host: str, port: int, since: float | None = None) -> PeerProtocol | None:
        self.since[port] = since
        return self.answers[port]

    def count_failure(self, reason: str) -> None:
        self.failures.append(reason)


def fetcher(answers: dict[int, PeerProtocol | None], *, radix: bool = True) -> KVFetcher:
    table: Any = SimpleNamespace(kv_ctx=SimpleNamespace(page_size=16, radix_cache=radix))
    aux: Any = AuxRows(SimpleNamespace(num_rows=4), None)  # type: ignore[arg-type]
    return KVFetcher(FakeRouter(answers), aux, table, None, None)  # type: ignore[arg-type]


def live(port: int) -> LiveRequest:
    cmd = AddRequest(f"r{port}", [1, 2, 3], SamplingParams(max_new_tokens=4), False,
                     "127.0.0.1", port, 7, 0.0)
    return LiveRequest(DecodeRequest(cmd.rid, 7, [1, 2, 3], 4), cmd, frozenset())


def waiting(f: KVFetcher, *lives: LiveRequest) -> None:
    for i, lv in enumerate(lives):
        f.wait_for_peer(lv, 100.0 + i)


def test_waiting_requests_are_released_once_their_peer_is_known() -> None:
    f = fetcher({1: None, 2: PeerProtocol("native"), 3: PeerProtocol("sglang", 16, 2)})
    waiting(f, live(1), live(2), live(3))
    out = f.resolve()
    assert [(lv.rid, why) for lv, why in out] == [("r2", None), ("r3", None)]
    assert out[0][0].req.sglang_page_size == 0 and out[1][0].req.sglang_page_size == 16
    assert [lv.rid for lv, _ in f.resolving] == ["r1"]  # still probing
    assert f.receiver.since == {1: 100.0, 2: 101.0, 3: 102.0}  # when each began waiting
    f.resolve()
    assert f.receiver.since[1] == 100.0  # the same request keeps its start


@pytest.mark.parametrize(("page", "radix", "words"), [
    (12, False, "does not divide the decode page size 16"),
    (8, True, "with the decode radix cache on"),
])
def test_an_sglang_page_size_we_cannot_take_ends_the_request_naming_the_fix(
        page: int, radix: bool, words: str) -> None:
    f = fetcher({5: PeerProtocol("sglang", page, 1)}, radix=radix)
    waiting(f, live(5))
    ((_, why),) = f.resolve()
    assert why is not None and why[0] == "transfer_failed"
    assert words in why[1] and "--page-size" in why[1] and "cache.page_size" in why[1]


def test_a_smaller_prefill_page_is_taken_without_the_radix_cache() -> None:
    f = fetcher({6: PeerProtocol("sglang", 8, 1)}, radix=False)
    waiting(f, live(6))
    ((lv, why),) = f.resolve()
    assert why is None and lv.req.sglang_page_size == 8


def test_an_unavailable_peer_ends_its_request_at_once_and_ended_requests_are_dropped() -> None:
    """Unreachable: peer_dead with the probe's words, counted with the transfer failures (as
    its transfer would have been); an answer from neither protocol: transfer_failed."""
    f = fetcher({7: PeerProtocol("unavailable", detail="prefill peer 127.0.0.1:7 is "
                                 "unreachable: connection refused"),
                 9: PeerProtocol("unavailable", detail="answers HTTP 404",
                                 reason="transfer_failed"), 8: None})
    gone = live(8)
    gone.ended = Ended("r8", "client_abort")
    waiting(f, live(7), gone, live(9))
    (lv, why), (lv9, why9) = f.resolve()
    assert lv.rid == "r7" and why == ("peer_dead", "prefill peer 127.0.0.1:7 is unreachable: "
                                      "connection refused")
    assert lv9.rid == "r9" and why9 == ("transfer_failed", "answers HTTP 404")
    assert f.receiver.failures == ["peer_dead", "transfer_failed"]
    assert f.resolving == [] and 8 not in f.receiver.since  # never asked for the ended one


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

    f = fetcher({})
    cmd = AddRequest("r", list(range(64)), SamplingParams(max_new_tokens=4), False, None, None,
                     None, 0.0)
    lv = LiveRequest(DecodeRequest("r", 7, list(range(64)), 4), cmd, frozenset())
    lv.restore = _Restoring()
    # 48 tokens reused: 1 page on the device, 2 pages (32 tokens) restored from the host
    f.fetch(lv, Admit(lv.req, 48, 48, [10, 11, 12, 13], [], HostRestore([5, 6], [10, 11])), 0.0)
    assert (lv.cached_tokens, lv.host_cached_tokens) == (48, 32)
    assert [g for g, _ in f.gated] == [lv]  # it waits for its restore
    f.fetch(lv, Admit(lv.req, 16, 48, [20, 21, 22], []), 1.0)  # readmitted, less reused
    assert (lv.cached_tokens, lv.host_cached_tokens) == (48, 32)
    f.fetch(lv, Admit(lv.req, 64, 48, [30], []), 2.0)  # more reused, all on the device
    assert (lv.cached_tokens, lv.host_cached_tokens) == (64, 0)
