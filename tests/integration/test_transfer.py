"""KV transfer end to end: a real prefill peer process, real NIXL over UCX, real ZMQ.

The decode side lives in the test process with its own pools (same tiny model). After each
transfer its pools must hold exactly the KV that a prefill of the same prompt computes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from decode_worker.core.pages import PageAllocator
from decode_worker.daemon.decode.books import receiver_totals
from decode_worker.daemon.prefill.main import build_runner
from decode_worker.daemon.shared.compat import model_compat, region_layouts
from decode_worker.device.aux_buffer import ROW_BYTES, AuxBuffer
from decode_worker.device.runner import ModelRunner
from decode_worker.io.kv import receiver as kv_receiver
from decode_worker.io.kv.receiver import KVReceiver, TransferEvent
from decode_worker.io.metrics import Metrics
from decode_worker.settings import TransferSettings, load_settings
from decode_worker.utils.mathx import align_down, cdiv
from tests.integration.conftest import PeerLaunch, start_prefill_peer, stop
from tests.waiting import wait_transfer

pytestmark = pytest.mark.slow
PS, WINDOW = 16, 127
RX_SETTINGS = TransferSettings(heartbeat_interval_s=0.2, peer_dead_after_s=1.5, abort_quiesce_s=1.0)


def window_start(seq_len: int) -> int:
    """S with the decode radix cache on (docs/CONTRACTS.md)."""
    return align_down(max(0, seq_len - 1 - max(WINDOW, PS)), PS)


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


class Cold(NamedTuple):
    """A submitted cold request: transfer id, its full and SWA pages, and S."""

    tid: int
    full: list[int]
    swa: list[int]
    s: int


@dataclass
class DecodeSide:
    runner: ModelRunner
    aux: AuxBuffer
    rx: KVReceiver
    full: PageAllocator
    swa: PageAllocator
    seen: list[TransferEvent] = field(default_factory=list)  # polled, not yet asked for

    def page_bytes(self) -> int:
        return self.runner.pools.page_bytes("full")

    def wait(self, tid: int, kind: str, timeout_s: float = 20.0) -> list[TransferEvent]:
        """Poll until transfer `tid` has an event of `kind`; returns its events so far."""
        return wait_transfer(self.rx.take_events, self.seen, tid, kind, timeout_s)

    def submit_cold(self, port: int, prompt: list[int], rid: str, room: int, aux_row: int,
                    timeout_s: float | None = None) -> Cold:
        """Allocate the pages of a cold request (full [0, L), SWA [S, L)) and submit it."""
        n, s = cdiv(len(prompt), PS), window_start(len(prompt))
        full, swa = self.full.alloc(n), self.swa.alloc(n - s // PS)
        extra = {} if timeout_s is None else {"timeout_s": timeout_s}
        tid = self.rx.submit("127.0.0.1", port, rid=rid, room=room, prompt_len=len(prompt),
                             reused_len=0, swa_window_start=s, full_page_ids=full,
                             swa_page_ids=swa, aux_row=aux_row, prompt_ids=prompt, **extra)
        return Cold(tid, full, swa, s)

    def reference(self, prompt: list[int]) -> tuple[list[int], list[int], int]:
        """Prefill locally into fresh pages: (full ids, swa ids, greedy first token)."""
        n = cdiv(len(prompt), PS)
        full, swa = self.full.alloc(n), self.swa.alloc(n)
        logits = self.runner.prefill(prompt, full, swa)
        return full, swa, int(torch.argmax(logits))


def tokens(pool: torch.Tensor, table: list[int], start: int, end: int) -> torch.Tensor:
    """KV of token positions [start, end); `table[i]` is the page of positions [i*PS, (i+1)*PS)
    (entries before start // PS are not read)."""
    first = start // PS
    pages = pool[:, table[first : cdiv(end, PS)]]  # [layers, n, 2, PS, heads, hd]
    flat = pages.permute(0, 2, 1, 3, 4, 5).flatten(2, 3)  # [layers, 2, n * PS, heads, hd]
    return flat[:, :, start - first * PS : end - first * PS]


def tail(s: int, swa_ids: list[int]) -> list[int]:
    """An SWA page table whose pages start at window start `s` (0 = not held before it)."""
    return [0] * (s // PS) + swa_ids


@pytest.fixture(scope="module")
def peers(model_cache: Path) -> Iterator[tuple[int, PeerLaunch]]:
    """The shared peer's port, and a spare peer (to be killed) started at the same time."""
    main, spare = PeerLaunch(0, model_cache), PeerLaunch(0, model_cache)
    try:
        main.ready()
        spare.ready()
        yield main.port, spare
    finally:
        stop(main.proc)
        stop(spare.proc)


@pytest.fixture(scope="module")
def prefill_peer(peers: tuple[int, PeerLaunch]) -> int:
    return peers[0]


@pytest.fixture(scope="module")
def decode(model_cache: Path) -> Iterator[DecodeSide]:
    s = load_settings(overrides={"model.cache_dir": str(model_cache), "cache.num_full_pages": 512,
                                 "cache.num_swa_pages": 512}).settings  # fmt: skip
    runner, name, _ = build_runner(s)
    aux = AuxBuffer(16)
    rx = KVReceiver(RX_SETTINGS, model_compat(runner, name), region_layouts(runner.pools, aux))
    yield DecodeSide(runner, aux, rx, PageAllocator(512, "full"), PageAllocator(512, "swa"))
    rx.close()


def test_cold_request_lands_exactly_the_prefill_kv(decode: DecodeSide, prefill_peer: int) -> None:
    prompt = prompt_of(300, seed=1)
    tid, full, swa, s = decode.submit_cold(prefill_peer, prompt, "cold", room=11, aux_row=1)
    (done,) = decode.wait(tid, "done")
    ref_full, ref_swa, token = decode.reference(prompt)
    pools = decode.runner.pools
    assert torch.equal(tokens(pools.full, full, 0, 300), tokens(pools.full, ref_full, 0, 300))
    assert torch.equal(tokens(pools.swa, tail(s, swa), s, 300), tokens(pools.swa, ref_swa, s, 300))
    row = decode.aux.check(1, room=11, transfer_id=tid)
    assert row is not None and row.token_id == token
    assert done.num_bytes == 2 * (len(full) + len(swa)) * decode.page_bytes() + ROW_BYTES
    assert done.num_descriptors == 5  # one run per layer (2 full + 2 swa) + the aux row
    assert done.num_tokens == 300
    metrics = Metrics()  # what the engine's books export from the receiver's counts
    metrics.set_totals(receiver_totals(decode.rx.stats))
    text = metrics.exposition()[0].decode()
    assert f"decode_worker_transfer_bytes_total {float(done.num_bytes)}" in text
    assert "decode_worker_transfer_received_tokens_total 300.0" in text


def test_second_turn_moves_only_the_suffix_and_swa_tail(
    decode: DecodeSide, prefill_peer: int
) -> None:
    turn1 = prompt_of(300, seed=2)
    first = decode.submit_cold(prefill_peer, turn1, "t1", room=21, aux_row=2)
    full1 = first.full
    decode.wait(first.tid, "done")
    turn2 = turn1 + prompt_of(200, seed=3)
    s2 = window_start(500)
    reused = min(align_down(300, PS), s2)  # 288: the tree holds turn 1's full pages
    kept = full1[: reused // PS]
    before = decode.runner.pools.full[:, kept].clone()
    new_full = decode.full.alloc(cdiv(500, PS) - reused // PS)
    swa2 = decode.swa.alloc(cdiv(500, PS) - s2 // PS)
    tid = decode.rx.submit("127.0.0.1", prefill_peer, rid="t2", room=22, prompt_len=500,
                           reused_len=reused, swa_window_start=s2, full_page_ids=new_full,
                           swa_page_ids=swa2, aux_row=3, prompt_ids=turn2)  # fmt: skip
    (done,) = decode.wait(tid, "done")
    pools = decode.runner.pools
    assert torch.equal(pools.full[:, kept], before)  # the reused prefix was not written
    assert done.num_bytes == 2 * (len(new_full) + len(swa2)) * decode.page_bytes() + ROW_BYTES
    ref_full, ref_swa, token = decode.reference(turn2)
    table = kept + new_full
    assert torch.equal(tokens(pools.full, table, reused, 500),
                       tokens(pools.full, ref_full, reused, 500))  # fmt: skip
    # The reused prefix came from turn 1's prefill (a shorter batch): equal up to rounding.
    torch.testing.assert_close(tokens(pools.full, table, 0, 500),
                               tokens(pools.full, ref_full, 0, 500))  # fmt: skip
    assert torch.equal(tokens(pools.swa, tail(s2, swa2), s2, 500),
                       tokens(pools.swa, ref_swa, s2, 500))  # fmt: skip
    row = decode.aux.check(3, room=22, transfer_id=tid)
    assert row is not None and row.token_id == token


def test_full_hit_sends_first_token_and_swa_tail_only(
    decode: DecodeSide, prefill_peer: int
) -> None:
    prompt = prompt_of(256, seed=4)
    s = window_start(256)
    swa = decode.swa.alloc(cdiv(256, PS) - s // PS)
    tid = decode.rx.submit("127.0.0.1", prefill_peer, rid="hit", room=31, prompt_len=256,
                           reused_len=256, swa_window_start=s, full_page_ids=[],
                           swa_page_ids=swa, aux_row=4, prompt_ids=prompt)  # fmt: skip
    (done,) = decode.wait(tid, "done")
    assert done.num_bytes == 2 * len(swa) * decode.page_bytes() + ROW_BYTES
    _, ref_swa, token = decode.reference(prompt)
    pools = decode.runner.pools
    assert torch.equal(tokens(pools.swa, tail(s, swa), s, 256), tokens(pools.swa, ref_swa, s, 256))
    row = decode.aux.check(4, room=31, transfer_id=tid)
    assert row is not None and row.token_id == token


def test_prefill_peer_killed_mid_transfer_fails_only_that_request(
    decode: DecodeSide, peers: tuple[int, PeerLaunch], model_cache: Path
) -> None:
    port, doomed = peers[1].port, peers[1].proc
    free_before = (decode.full.num_free, decode.swa.num_free)
    prompt = prompt_of(3000, seed=5)
    t0 = time.monotonic()
    tid, full, swa, _ = decode.submit_cold(port, prompt, "doomed", room=41, aux_row=5,
                                           timeout_s=20.0)
    while time.monotonic() - t0 < 0.3:  # handshake done, prefill running
        assert not decode.rx.take_events()
        time.sleep(0.01)
    doomed.kill()
    killed_at = time.monotonic()
    events = decode.wait(tid, "failed", timeout_s=10.0)
    failed = next(e for e in events if e.kind == "failed")
    assert failed.reason == "peer_dead" and "connection closed" in failed.detail
    assert time.monotonic() - killed_at < 1.0  # its connection closed: no heartbeat to miss
    events += decode.wait(tid, "released", timeout_s=5.0)
    assert [e.kind for e in events] == ["failed", "released"]
    decode.full.free(full)
    decode.swa.free(swa)
    assert (decode.full.num_free, decode.swa.num_free) == free_before
    stop(doomed)
    # The receiver is still usable: a peer restarted on the same address serves again.
    reborn = start_prefill_peer(port, model_cache)
    try:
        test_full_hit_sends_first_token_and_swa_tail_only(decode, port)
    finally:
        stop(reborn)


def test_incompatible_peer_is_refused_naming_both_sides(
    decode: DecodeSide, prefill_peer: int
) -> None:
    compat = decode.rx.compat
    other = type(compat)(**{**{f: getattr(compat, f) for f in compat.__struct_fields__},
                            "page_size": 32, "model": "other-model"})  # fmt: skip
    rx = KVReceiver(RX_SETTINGS, other, decode.rx.regions, agent_name="decode-incompatible")
    try:
        tid = rx.submit("127.0.0.1", prefill_peer, rid="bad", room=51, prompt_len=64,
                        reused_len=0, swa_window_start=0, full_page_ids=[1, 2],
                        swa_page_ids=[3, 4], aux_row=0, prompt_ids=[1] * 64)  # fmt: skip
        events = DecodeSide(decode.runner, decode.aux, rx, decode.full, decode.swa).wait(
            tid, "released", timeout_s=10.0
        )
    finally:
        rx.close()
    failed = events[0]
    assert failed.kind == "failed" and failed.reason == "transfer_failed"
    assert "page_size: decode=32 prefill=16" in failed.detail
    assert "model: decode='other-model' prefill=" in failed.detail


def test_bad_page_ids_fail_before_anything_moves(decode: DecodeSide, prefill_peer: int) -> None:
    top = decode.runner.pools.num_pages["full"]
    tid = decode.rx.submit("127.0.0.1", prefill_peer, rid="ids", room=61, prompt_len=40,
                           reused_len=0, swa_window_start=0, full_page_ids=[1, 2, top + 1],
                           swa_page_ids=[1, 2, 3], aux_row=0, prompt_ids=[7] * 40)  # fmt: skip
    events = decode.rx.take_events()
    assert [(e.kind, e.reason) for e in events if e.transfer_id == tid] == [
        ("failed", "bad_request"), ("released", None)
    ]


def test_the_peer_refuses_bad_page_ids_that_a_decode_side_did_not_check(
        decode: DecodeSide, prefill_peer: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-conforming decode client: the peer answers TransferFailed at once (no kv_timeout)
    and writes nothing."""
    monkeypatch.setattr(kv_receiver, "validate_request", lambda *args: None)
    top = decode.runner.pools.num_pages["full"]
    t0 = time.monotonic()
    tid = decode.rx.submit("127.0.0.1", prefill_peer, rid="ids-peer", room=62, prompt_len=40,
                           reused_len=0, swa_window_start=0, full_page_ids=[1, 2, top + 1],
                           swa_page_ids=[1, 2, 3], aux_row=0, prompt_ids=[7] * 40)  # fmt: skip
    events = decode.wait(tid, "released", timeout_s=5.0)
    assert [(e.kind, e.reason) for e in events] == [
        ("failed", "transfer_failed"), ("released", None)]
    assert "page id out of" in events[0].detail and time.monotonic() - t0 < 3.0


def test_abort_returns_pages_once_the_peer_confirms(decode: DecodeSide, prefill_peer: int) -> None:
    prompt = prompt_of(1000, seed=6)
    tid, full, swa, _ = decode.submit_cold(prefill_peer, prompt, "abort", room=71, aux_row=6)
    decode.rx.take_events()  # the request goes out
    decode.rx.abort_transfer(tid)
    t0 = time.monotonic()
    events = decode.wait(tid, "released", timeout_s=5.0)
    assert [e.kind for e in events] == ["released"]  # no "failed": the owner asked for it
    assert time.monotonic() - t0 < RX_SETTINGS.abort_quiesce_s + 2.0
    decode.full.free(full)
    decode.swa.free(swa)


def test_missing_prompt_times_out_with_kv_timeout(decode: DecodeSide, prefill_peer: int) -> None:
    t0 = time.monotonic()
    tid = decode.rx.submit("127.0.0.1", prefill_peer, rid="lonely", room=81, prompt_len=32,
                           reused_len=0, swa_window_start=0, full_page_ids=[1, 2],
                           swa_page_ids=[1, 2], aux_row=7, timeout_s=1.0)  # fmt: skip
    events = decode.wait(tid, "released", timeout_s=6.0)
    assert [(e.kind, e.reason) for e in events] == [("failed", "kv_timeout"), ("released", None)]
    assert 1.0 <= time.monotonic() - t0 < 4.0


def test_unknown_and_late_notifications_are_counted_not_fatal(
    decode: DecodeSide, prefill_peer: int
) -> None:
    from decode_worker.io.kv import protocol
    from decode_worker.io.kv.nixl_agent import NixlAgent

    finished = decode.rx.submit("127.0.0.1", prefill_peer, rid="gone", room=91, prompt_len=16,
                                reused_len=0, swa_window_start=0, full_page_ids=[0],
                                swa_page_ids=[1], aux_row=0)  # fmt: skip
    assert [e.kind for e in decode.rx.take_events()] == ["failed", "released"]  # page id 0: bad
    rogue = NixlAgent("rogue-sender", "UCX", RX_SETTINGS.progress_delay_us)
    try:
        peer = rogue.add_peer(decode.rx.agent.metadata())
        stats = decode.rx.stats
        before = (stats.unknown_notifs, stats.late_notifs)
        rogue.send_notif(peer, b"not ours")
        rogue.send_notif(peer, protocol.encode_notif(protocol.Notif(finished, 91, 0, 1, 1)))
        deadline = time.monotonic() + 5.0
        while (stats.unknown_notifs, stats.late_notifs) != (before[0] + 1, before[1] + 1):
            assert not decode.rx.take_events()
            assert time.monotonic() < deadline, (stats, before)
            time.sleep(0.005)
    finally:
        rogue.close()
    test_full_hit_sends_first_token_and_swa_tail_only(decode, prefill_peer)  # still serving


def test_concurrent_requests_each_land_their_own_kv(decode: DecodeSide, prefill_peer: int) -> None:
    lens = [150, 40, 333, 97]
    prompts = [prompt_of(n, seed=100 + i) for i, n in enumerate(lens)]
    tables, tids = [], []
    for i, prompt in enumerate(prompts):
        cold = decode.submit_cold(prefill_peer, prompt, f"c{i}", room=200 + i, aux_row=8 + i)
        tables.append(cold.full)
        tids.append(cold.tid)
    for tid in tids:
        assert decode.wait(tid, "done")[-1].kind == "done"
    pools = decode.runner.pools
    for i, (prompt, full) in enumerate(zip(prompts, tables, strict=True)):
        ref_full, _, token = decode.reference(prompt)
        L = len(prompt)
        assert torch.equal(tokens(pools.full, full, 0, L), tokens(pools.full, ref_full, 0, L))
        row = decode.aux.check(8 + i, room=200 + i, transfer_id=tids[i])
        assert row is not None and row.token_id == token


@pytest.mark.parametrize(("host", "port"), [("", 5000), ("127.0.0.1", 0), ("no such host!", 1)])
def test_a_bad_peer_address_fails_only_that_request(
    decode: DecodeSide, host: str, port: int
) -> None:
    tid = decode.rx.submit(host, port, rid="addr", room=301, prompt_len=16, reused_len=0,
                           swa_window_start=0, full_page_ids=[1], swa_page_ids=[1],
                           aux_row=0)  # fmt: skip
    events = decode.wait(tid, "released", timeout_s=5.0)
    assert [e.kind for e in events] == ["failed", "released"]
