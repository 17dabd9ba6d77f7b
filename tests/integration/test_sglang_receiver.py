"""`SglangReceiver` against SGLang 0.5.23's own prefill code (tests/interop/sglang_prefill/ under
the SGLang venv of scripts/setup_sglang.sh; skipped without it): real HTTP bootstrap, raw ZMQ
frames, NIXL writes over UCX on loopback into this worker's pool layout, in this process.

The harness writes a seeded hash as KV (`kv_bits`, numpy copy in the harness's layout.py): every
landed byte of the full pages of [P, L) and of the SWA window is compared with it. Ports:
18300-18399 only (harness HTTP/ZMQ/UCX ranges, our status socket, our UCX listener).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
import zmq

from decode_worker.core.window import sglang_window_start
from decode_worker.daemon.shared.compat import region_layouts
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.device.kv_pool import KVPools, KVSpec
from decode_worker.device.model.config import FULL, SLIDING
from decode_worker.io.kv.peer import TransferEvent, TransferReceiver
from decode_worker.io.kv.protocol import ModelCompat
from decode_worker.io.kv.router import ProtocolRouter
from decode_worker.io.kv.sglang.receiver import SglangReceiver
from decode_worker.settings import TransferSettings
from decode_worker.utils.mathx import align_down, cdiv
from tests.interop.sglang_peer import HarnessPorts, SglangPrefill, venv_python
from tests.waiting import wait_transfer, wait_value

pytestmark = pytest.mark.slow
PYTHON = venv_python()
if PYTHON is None:
    pytest.skip("no SGLang venv (bash scripts/setup_sglang.sh)", allow_module_level=True)

_spec = importlib.util.spec_from_file_location(
    "sglang_rig_layout", Path(__file__).resolve().parents[1] / "interop/sglang_prefill/layout.py")
assert _spec is not None and _spec.loader is not None
rig = sys.modules.setdefault("sglang_rig_layout", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(rig)

log = logging.getLogger(__name__)
LAYERS = (SLIDING, FULL, SLIDING, FULL)  # the harness's default: sliding 0 and 2
HEADS, HEAD_DIM, WINDOW, PS_P = 2, 16, 127, 16
SETTINGS = TransferSettings(heartbeat_interval_s=0.2, peer_dead_after_s=1.5, abort_quiesce_s=8.0)
# One harness rank listens on 9 UCX ports (8 transfer threads + 1); our agent on 1 (lo only).
A = HarnessPorts(18300, 18301, "18310-18312", "18320-18334")  # TP 1
B = HarnessPorts(18302, 18303, "18313-18316", "18335-18359")  # TP 2
OUR_ZMQ, OUR_UCX = (18306, 18309), "18375-18389"
AUX_SCHEMA = ((torch.int32, 16), (torch.int32, 16), (torch.float32, 16), (torch.int32, 16),
              (torch.float32, 128), (torch.int32, 128), (torch.float32, 16), (torch.int64, 16),
              (torch.float32, 16), (torch.int64, 8))  # fmt: skip


@dataclass
class Decode:
    """Our pools, SGLang's aux buffers and a receiver, in this process."""

    page_size: int
    pools: KVPools
    aux: list[torch.Tensor]
    rx: TransferReceiver
    next_full: int = 1
    next_swa: int = 1
    seen: list[TransferEvent] = field(default_factory=list)

    def alloc(self, pool: Literal["full", "swa"], n: int) -> list[int]:
        """Scattered page ids: every third page, wrapping."""
        attr = f"next_{pool}"
        first, total = getattr(self, attr), self.pools.num_pages[pool]
        ids = [1 + (first + 3 * i) % total for i in range(n)]
        setattr(self, attr, first + 3 * n + 1)
        return ids

    def wait(self, tid: int, kind: str, timeout_s: float = 30.0) -> list[TransferEvent]:
        """Poll until transfer `tid` has an event of `kind`; returns its events so far."""
        return wait_transfer(self.rx.take_events, self.seen, tid, kind, timeout_s)


@dataclass
class Room:
    tid: int
    room: int
    seq_len: int
    prefix: int
    full: list[int]  # our pages of [prefix, L)
    swa_base: int  # first token of our first SWA page
    swa: list[int]
    ws: int  # SGLang's window start
    seed: int


@pytest.fixture(scope="module", autouse=True)
def our_ucx_ports() -> Iterator[None]:
    """UCX reads these when an agent is built: our agents listen on loopback in our block."""
    env = {"UCX_TCP_PORT_RANGE": OUR_UCX, "UCX_NET_DEVICES": "lo"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def harnesses() -> Iterator[dict[str, SglangPrefill]]:
    """A (TP 1) and B (TP 2), started together."""
    assert PYTHON is not None
    started = {"A": SglangPrefill(PYTHON, A, []).start(),
               "B": SglangPrefill(PYTHON, B, ["--tp-size", "2"]).start()}
    try:
        for h in started.values():
            h.wait_ready()
        yield started
    finally:
        for h in started.values():
            h.kill()


def make_decode(page_size: int, **kwargs: Any) -> Decode:
    pools = KVPools(KVSpec(LAYERS, HEADS, HEAD_DIM), 64, 64, page_size, "cpu", torch.bfloat16)
    aux = [torch.zeros(16, width, dtype=dtype) for dtype, width in AUX_SCHEMA]
    regions = region_layouts(pools, AuxBuffer(4))
    bufs = [(t.data_ptr(), t.shape[1] * t.element_size(), t.shape[0]) for t in aux]
    rx = SglangReceiver(kwargs.pop("settings", SETTINGS), compat(page_size), regions, bufs,
                        zmq_ports=OUR_ZMQ, **kwargs)  # fmt: skip
    return Decode(page_size, pools, aux, rx)


def compat(page_size: int) -> ModelCompat:
    kinds = ["swa" if t == SLIDING else "full" for t in LAYERS]
    return ModelCompat("tiny", "bfloat16", kinds, HEADS, HEAD_DIM, page_size, WINDOW)


@pytest.fixture
def decode16() -> Iterator[Decode]:
    d = make_decode(16)
    yield d
    d.rx.close()


@pytest.fixture
def decode32() -> Iterator[Decode]:
    d = make_decode(32)
    yield d
    d.rx.close()


def submit(d: Decode, harness: SglangPrefill | None, port: int, room: int, seq_len: int,
           prefix: int = 0, seed: int = 0, **spec: Any) -> Room:
    """Start the room on the harness (as the router would) and submit it here."""
    ps = d.page_size
    ws = sglang_window_start(prefix, seq_len, WINDOW, PS_P)
    base = align_down(ws, ps)
    full = d.alloc("full", cdiv(seq_len, ps) - prefix // ps)
    swa = d.alloc("swa", cdiv(seq_len, ps) - base // ps)
    if harness is not None:
        harness.prefill({"room": room, "input_ids": [7] * seq_len, "seed": seed,
                         "first_token": 1000 + room % 1000, **spec})  # fmt: skip
    tid = d.rx.submit("127.0.0.1", port, rid=f"r{room}", room=room, prompt_len=seq_len,
                      reused_len=prefix, swa_window_start=ws, full_page_ids=full,
                      swa_page_ids=swa, aux_row=room % 16)  # fmt: skip
    return Room(tid, room, seq_len, prefix, full, base, swa, ws, seed)


def mismatches(d: Decode, r: Room) -> list[str]:
    """Landed KV vs the harness's kv_bits: full layers over [prefix, L), SWA over [ws, L)."""
    ps, out, heads = d.page_size, [], np.arange(HEADS)
    for layer, kind_name in enumerate(LAYERS):
        pool, index = d.pools.layer_slot(layer)
        is_swa = kind_name == SLIDING
        positions = np.arange(r.ws if is_swa else r.prefix, r.seq_len)
        if not len(positions):  # a full hit: nothing of this layer is sent
            continue
        table = r.swa if is_swa else r.full
        first = r.swa_base if is_swa else r.prefix
        t = d.pools.tensor(pool)[index]  # [pages + 1, 2, ps, heads, head_dim]
        for kind in (0, 1):
            got = torch.stack([t[table[(q - first) // ps], kind, q % ps] for q in positions])
            want = rig.kv_bits(r.seed, layer, kind, positions, heads, HEAD_DIM, 2)
            bad = np.argwhere(got.view(torch.int16).numpy() != want.view(np.int16))
            if len(bad):
                out.append(f"layer {layer} {'KV'[kind]}: {len(bad)} values differ, first at "
                           f"position {positions[bad[0][0]]}")
    return out


def check_room(d: Decode, r: Room, timeout_s: float = 30.0) -> TransferEvent:
    (done,) = d.wait(r.tid, "done", timeout_s)
    assert done.protocol == "sglang" and done.num_tokens == r.seq_len - r.prefix
    assert mismatches(d, r) == []
    row = r.room % 16
    assert int(d.aux[9][row, 0]) == r.room  # bootstrap_room: the landed flag
    assert int(d.aux[0][row, 0]) == 1000 + r.room % 1000  # output_ids[0]: the first token
    log.info("room %d (L=%d P=%d, page %d): done in %.1f ms", r.room, r.seq_len, r.prefix,
             d.page_size, 1e3 * done.duration_s)  # fmt: skip
    return done


def test_two_rooms_land_byte_exact_with_equal_pages(
    harnesses: dict[str, SglangPrefill], decode16: Decode
) -> None:
    """Then a full hit (P = L = 256): SGLang's sender takes our TransferInfo with no KV ids
    and an empty state list as its own decode's, and writes the aux row only."""
    first = submit(decode16, harnesses["A"], A.bootstrap, 3001, 300, seed=11)
    check_room(decode16, first)
    second = submit(decode16, harnesses["A"], A.bootstrap, 3002, 250, prefix=64, seed=12)
    check_room(decode16, second)
    assert harnesses["A"].wait_room(3002)["ranks"][0]["decode_prefix_len"] == 64
    hit = submit(decode16, harnesses["A"], A.bootstrap, 3003, 256, prefix=256, seed=13)
    assert (hit.full, hit.swa, hit.ws) == ([], [], 256)
    check_room(decode16, hit)
    rank = harnesses["A"].wait_room(3003)["ranks"][0]
    assert (rank["status"], rank["decode_prefix_len"]) == ("success", 256), rank


def test_decode_page_twice_the_prefill_page(
    harnesses: dict[str, SglangPrefill], decode32: Decode
) -> None:
    for room, seq_len, prefix in ((3101, 300, 0), (3102, 181, 64), (3103, 40, 0)):
        check_room(decode32, submit(decode32, harnesses["A"], A.bootstrap, room, seq_len,
                                    prefix=prefix, seed=room))  # fmt: skip


def test_prefill_tp2_needs_both_ranks(
    harnesses: dict[str, SglangPrefill], decode32: Decode
) -> None:
    r = submit(decode32, harnesses["B"], B.bootstrap, 3201, 200, seed=5)
    check_room(decode32, r)
    state = harnesses["B"].wait_room(3201)
    assert [x["status"] for x in state["ranks"]] == ["success", "success"]


@pytest.mark.parametrize("fail, reason", [
    ("status", "synthetic NIXL error 42"),
    ("state_mismatch", "State index length mismatch at component 0"),
])  # fmt: skip
def test_a_failed_room_fails_with_the_peers_reason_then_is_released(
    harnesses: dict[str, SglangPrefill], decode16: Decode, fail: str, reason: str
) -> None:
    r = submit(decode16, harnesses["A"], A.bootstrap, 3301, 200, fail=fail,
               fail_reason="synthetic NIXL error 42")
    failed, released = decode16.wait(r.tid, "released")
    assert failed.kind == "failed" and failed.reason == "transfer_failed"
    assert reason in failed.detail and released.kind == "released"


def test_a_room_the_prefill_drops_silently_times_out_then_is_released_on_abort_ack(
    harnesses: dict[str, SglangPrefill], decode16: Decode
) -> None:
    """SGLang's prefill-side abort tells the decode nothing: our deadline ends it (kv_timeout),
    our ABORT gets its ABORT_ACK, the pages come back before the quiesce bound."""
    ps, seq_len = 16, 100
    harnesses["A"].prefill({"room": 3311, "input_ids": [7] * seq_len, "fail": "abort"})
    ws = sglang_window_start(0, seq_len, WINDOW, PS_P)
    tid = decode16.rx.submit(
        "127.0.0.1", A.bootstrap, rid="r3311", room=3311, prompt_len=seq_len, reused_len=0,
        swa_window_start=ws, full_page_ids=decode16.alloc("full", cdiv(seq_len, ps)),
        swa_page_ids=decode16.alloc("swa", cdiv(seq_len, ps) - ws // ps), aux_row=3,
        timeout_s=2.0)  # fmt: skip
    start = time.monotonic()
    failed, released = decode16.wait(tid, "released", timeout_s=SETTINGS.abort_quiesce_s)
    assert failed.reason == "kv_timeout" and released.kind == "released"
    assert time.monotonic() - start < SETTINGS.abort_quiesce_s - 1
    assert decode16.rx.stats.quiesce_expired == 0


def test_malformed_and_unknown_status_messages_are_counted_and_dropped(
    harnesses: dict[str, SglangPrefill], decode16: Decode
) -> None:
    check_room(decode16, submit(decode16, harnesses["A"], A.bootstrap, 3321, 50))
    port = decode16.rx._inbox.endpoint_for("127.0.0.1")  # type: ignore[attr-defined]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"tcp://127.0.0.1:{port}")
    for frames in ([b"garbage"], [b"KV_STATUS", b"x", b"4", b"0", b""],
                   [b"KV_STATUS", b"999999", b"4", b"0", b""]):
        push.send_multipart(frames)
    push.close()
    ctx.term()
    stats = decode16.rx.stats

    def counted() -> bool | None:
        decode16.seen += decode16.rx.take_events()
        return (stats.bad_frames == 2 and stats.unknown_notifs == 1) or None

    wait_value(counted, 5.0)
    check_room(decode16, submit(decode16, harnesses["A"], A.bootstrap, 3322, 50))


def test_an_aborted_room_is_released_on_abort_ack(
    harnesses: dict[str, SglangPrefill], decode16: Decode
) -> None:
    check_room(decode16, submit(decode16, harnesses["A"], A.bootstrap, 3401, 64))  # registered
    r = submit(decode16, harnesses["A"], A.bootstrap, 3402, 300, delay_s=3.0)
    harnesses["A"].wait_room(3402, ("waiting_for_input", "transferring"), timeout_s=10)
    start = time.monotonic()
    decode16.rx.abort_transfer(r.tid)
    (released,) = decode16.wait(r.tid, "released", timeout_s=SETTINGS.abort_quiesce_s - 1)
    assert released.kind == "released"  # no "failed": the owner asked for it
    assert time.monotonic() - start < SETTINGS.abort_quiesce_s - 1
    assert decode16.rx.stats.quiesce_expired == 0
    assert harnesses["A"].wait_room(3402)["status"] == "failed"


def test_a_prefill_page_that_does_not_divide_ours_fails_fast(
    harnesses: dict[str, SglangPrefill]
) -> None:
    d = make_decode(24)
    try:
        start = time.monotonic()
        r = submit(d, None, A.bootstrap, 3501, 100)
        failed, _released = d.wait(r.tid, "released", timeout_s=5)
        assert failed.reason == "transfer_failed" and time.monotonic() - start < 5
        assert "page size 16" in failed.detail or "page_size=16" in failed.detail
        assert "--page-size" in failed.detail and "cache.page_size" in failed.detail
    finally:
        d.rx.close()


def _wait_failed(d: Decode, r: Room, timeout_s: float) -> tuple[TransferEvent, float]:
    start = time.monotonic()
    events = d.wait(r.tid, "failed", timeout_s)
    return next(e for e in events if e.kind == "failed"), time.monotonic() - start


def test_a_silent_then_killed_prefill_fails_peer_dead_and_a_restart_registers_again(
        harnesses: dict[str, SglangPrefill]) -> None:
    """On harness A, which no later test in this file uses (it is SIGSTOPped, killed, and
    restarted behind the same address, where this test kills it again)."""
    assert PYTHON is not None
    d = make_decode(16)
    harness = harnesses["A"]
    try:
        check_room(d, submit(d, harness, A.bootstrap, 3601, 80))
        r = submit(d, harness, A.bootstrap, 3602, 300, delay_s=30.0)
        state = harness.wait_room(3602, ("waiting_for_input", "transferring"), timeout_s=10)
        assert state["status"] in ("waiting_for_input", "transferring"), state  # in flight
        assert harness.proc is not None
        os.killpg(harness.proc.pid, signal.SIGSTOP)  # alive but silent: /health times out
        failed, took = _wait_failed(d, r, SETTINGS.peer_dead_after_s + 5)
        assert failed.reason == "peer_dead" and took >= SETTINGS.peer_dead_after_s - 0.5
        harness.kill()
        harness = SglangPrefill(PYTHON, A, []).start()  # restarted behind the same address
        harness.wait_ready()
        check_room(d, submit(d, harness, A.bootstrap, 3603, 120, seed=3))
        r = submit(d, harness, A.bootstrap, 3604, 120, fail="die")  # dies on our TransferInfo
        failed, took = _wait_failed(d, r, SETTINGS.peer_dead_after_s + 5)
        assert failed.reason == "peer_dead" and took < SETTINGS.peer_dead_after_s + 1
    finally:
        harness.kill()
        d.rx.close()


def test_the_router_probes_sglang_and_routes_to_it(harnesses: dict[str, SglangPrefill]) -> None:
    pools = KVPools(KVSpec(LAYERS, HEADS, HEAD_DIM), 64, 64, 16, "cpu", torch.bfloat16)
    aux = [torch.zeros(16, width, dtype=dtype) for dtype, width in AUX_SCHEMA]
    bufs = [(t.data_ptr(), t.shape[1] * t.element_size(), t.shape[0]) for t in aux]
    router = ProtocolRouter(SETTINGS, compat(16), region_layouts(pools, AuxBuffer(4)), bufs,
                            peer_protocol="auto", zmq_ports=OUR_ZMQ)  # fmt: skip
    try:
        proto = wait_value(lambda: router.protocol_of("127.0.0.1", B.bootstrap), 10.0)
        assert (proto.kind, proto.prefill_page_size, proto.tp_size) == ("sglang", 16, 2)
        d = Decode(16, pools, aux, router)
        r = submit(d, harnesses["B"], B.bootstrap, 3701, 150, seed=9)
        check_room(d, r)
        assert router.peers_by_protocol() == {"native": 0, "sglang": 1}
        assert router.stats.done == 1 and router.num_in_flight == 0
        _check_native_and_unavailable_peers(router)
    finally:
        router.close()


def _check_native_and_unavailable_peers(router: ProtocolRouter) -> None:
    """A ZMQ socket is a native peer; a closed port is unavailable and a submit to it fails
    peer_dead at once."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:18393")
    try:
        assert wait_value(lambda: router.protocol_of("127.0.0.1", 18393), 5.0).kind == "native"
    finally:
        sock.close()
        ctx.term()
    since = time.monotonic()  # a caller waits for the probe that answers after it asked
    proto = wait_value(lambda: router.protocol_of("127.0.0.1", 18394, since), 5.0)
    assert proto.kind == "unavailable" and "unreachable" in proto.detail
    tid = router.submit("127.0.0.1", 18394, rid="x", room=1, prompt_len=16, reused_len=0,
                        swa_window_start=0, full_page_ids=[1], swa_page_ids=[1], aux_row=0)
    failed, released = router.take_events()
    assert (failed.kind, failed.reason, released.kind) == ("failed", "peer_dead", "released")
    assert failed.transfer_id == released.transfer_id == tid
    assert router.peers_by_protocol() == {"native": 1, "sglang": 1}


def test_only_the_ranks_that_have_not_reported_get_an_abort(
    harnesses: dict[str, SglangPrefill], decode16: Decode
) -> None:
    """Prefill TP 2: rank 0 fails the room itself while rank 1 still "computes" (3 s). The
    failure answers at once; our ABORT goes to rank 1 alone, which acks it, and the pages come
    back before the quiesce bound. Rank 0 keeps its own cause. Ending the room's request
    afterwards (`cancel_room`, as the request table does) sends no rank anything more."""
    reason = "synthetic NIXL error on rank 0"
    r = submit(decode16, harnesses["B"], B.bootstrap, 3501, 200, fail="status", fail_ranks=[0],
               fail_reason=reason, delay_s=3.0)
    failed, released = decode16.wait(r.tid, "released", timeout_s=SETTINGS.abort_quiesce_s)
    assert failed.kind == "failed" and reason in failed.detail and released.kind == "released"
    assert decode16.rx.stats.quiesce_expired == 0
    decode16.rx.cancel_room("127.0.0.1", B.bootstrap, r.room, "abort", "the client left")
    # the same PUSH links, in order: an ABORT for 3501 would reach each rank before this room
    check_room(decode16, submit(decode16, harnesses["B"], B.bootstrap, 3502, 64))
    ranks = harnesses["B"].room(r.room)["ranks"]  # type: ignore[index]
    assert ranks[0].get("decode_aborts", 0) == 0 and reason in ranks[0]["reason"], ranks
    assert ranks[1].get("decode_aborts", 0) == 1, ranks


class HeldInbox:
    """Stands for the status inbox's `recv_all`: what `fill` took from the socket is handed
    to the receiver first, as if it had waited in the socket until the receiver read it."""

    def __init__(self, recv_all: Callable[[], list[Any]]) -> None:
        self.recv_all = recv_all
        self.held: list[Any] = []

    def fill(self, n: int) -> bool | None:
        self.held += self.recv_all()
        return len(self.held) >= n or None

    def __call__(self) -> list[Any]:
        out, self.held = [*self.held, *self.recv_all()], []
        return out


def test_a_request_ended_before_the_failure_was_polled_aborts_no_rank(
    harnesses: dict[str, SglangPrefill], decode16: Decode
) -> None:
    """Prefill TP 2: both ranks fail the room themselves and report it, and the request ends
    (a client disconnect or a drain: the request table's `cancel_room`, then `abort` of its
    transfer) after both reports arrived but before a `poll` read them. The reports are read
    first, so no rank gets an ABORT and both keep their own cause; the failure and the release
    still come out of the next poll, without waiting for the quiesce bound."""
    reason = "synthetic NIXL error on every rank"
    rx, inbox = decode16.rx, decode16.rx._inbox  # type: ignore[attr-defined]
    r = submit(decode16, harnesses["B"], B.bootstrap, 3511, 200, fail="status",
               fail_reason=reason)

    def info_sent() -> bool | None:  # no poll after our TransferInfo went out
        decode16.seen += rx.take_events()
        return rx._book.get(r.tid).phase == "sent" or None  # type: ignore[attr-defined]

    wait_value(info_sent, 10.0)
    held = HeldInbox(inbox.recv_all)
    wait_value(lambda: held.fill(2), 10.0)  # both ranks' reports arrived; the receiver read none
    inbox.recv_all = held
    rx.cancel_room("127.0.0.1", B.bootstrap, r.room, "client_abort", "the client left")
    rx.abort_transfer(r.tid)
    failed, released = decode16.wait(r.tid, "released", timeout_s=SETTINGS.abort_quiesce_s - 1)
    assert failed.kind == "failed" and reason in failed.detail and released.kind == "released"
    assert rx.stats.quiesce_expired == 0
    # the same PUSH links, in order: an ABORT for 3511 would reach each rank before this room
    check_room(decode16, submit(decode16, harnesses["B"], B.bootstrap, 3512, 64))
    ranks = harnesses["B"].room(r.room)["ranks"]  # type: ignore[index]
    assert [x.get("decode_aborts", 0) for x in ranks] == [0, 0], ranks
    assert all(reason in x["reason"] for x in ranks), ranks
