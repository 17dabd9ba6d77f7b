"""The prefill peer's HTTP side: /generate with bootstrap_room meets the decode side's transfer
request for that room, whichever arrives first; a room nobody asks for times out cleanly."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from decode_worker.daemon.prefill.main import build_runner
from decode_worker.daemon.shared.compat import model_compat, region_layouts
from decode_worker.device.aux_buffer import AuxBuffer
from decode_worker.io.kv.receiver import KVReceiver, TransferEvent
from decode_worker.settings import TransferSettings, load_settings
from decode_worker.utils.mathx import align_down, cdiv
from tests.integration.conftest import launch_prefill_peer, stop

pytestmark = pytest.mark.slow
PS = 16


@pytest.fixture(scope="module")
def peer(model_cache: Path) -> Iterator[tuple[int, int]]:
    """(bootstrap port, http port) of a prefill peer that gives up on a lone half after 3 s."""
    launch = launch_prefill_peer(model_cache, "--set", "scheduler.kv_timeout_s=3")
    yield launch.port, launch.http_port
    stop(launch.proc)


@pytest.fixture(scope="module")
def rx(model_cache: Path) -> Iterator[tuple[KVReceiver, AuxBuffer]]:
    s = load_settings(overrides={"model.cache_dir": str(model_cache), "cache.num_full_pages": 64,
                                 "cache.num_swa_pages": 64}).settings  # fmt: skip
    runner, name, _ = build_runner(s)
    aux = AuxBuffer(4)
    settings = TransferSettings(heartbeat_interval_s=0.2, peer_dead_after_s=2.0)
    receiver = KVReceiver(settings, model_compat(runner, name), region_layouts(runner.pools, aux))
    yield receiver, aux
    receiver.close()


def _post(hport: int, bport: int, room: int, ids: list[int], out: list[httpx.Response]) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8}, "bootstrap_room": room,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bport}  # fmt: skip
    out.append(httpx.post(f"http://127.0.0.1:{hport}/generate", json=body, timeout=20.0))


def _submit(receiver: KVReceiver, bport: int, room: int, n: int) -> int:
    s = align_down(max(0, n - 1 - 127), PS)
    pages = cdiv(n, PS)
    return receiver.submit("127.0.0.1", bport, rid=f"r{room}", room=room, prompt_len=n,
                           reused_len=0, swa_window_start=s,
                           full_page_ids=list(range(1, pages + 1)),
                           swa_page_ids=list(range(1, pages - s // PS + 1)), aux_row=room % 4,
                           timeout_s=10.0)  # fmt: skip


def _wait(receiver: KVReceiver, tid: int, timeout_s: float = 15.0) -> TransferEvent:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in receiver.take_events():
            if ev.transfer_id == tid and ev.kind != "released":
                return ev
        time.sleep(0.002)
    raise AssertionError(f"transfer {tid} did not end")


@pytest.mark.parametrize("http_first", [True, False])
def test_http_prompt_and_transfer_request_meet_by_room(
    rx: tuple[KVReceiver, AuxBuffer], peer: tuple[int, int], http_first: bool
) -> None:
    receiver, aux = rx
    bport, hport = peer
    room = 100 + http_first
    ids = [(7 * i) % 256 for i in range(200)]
    out: list[httpx.Response] = []
    poster = threading.Thread(target=_post, args=(hport, bport, room, ids, out))
    if http_first:
        poster.start()
        time.sleep(0.3)
        tid = _submit(receiver, bport, room, len(ids))
    else:
        tid = _submit(receiver, bport, room, len(ids))
        for _ in range(50):
            receiver.take_events()
            time.sleep(0.006)
        poster.start()
    ev = _wait(receiver, tid)
    poster.join(20)
    assert ev.kind == "done", ev
    (resp,) = out
    assert resp.status_code == 200, resp.text
    row = aux.check(room % 4, room=room, transfer_id=tid)
    assert row is not None and resp.json()["output_ids"] == [row.token_id]


def test_http_prompt_without_a_transfer_request_times_out(peer: tuple[int, int]) -> None:
    bport, hport = peer
    out: list[httpx.Response] = []
    t0 = time.monotonic()
    _post(hport, bport, 555, [1, 2, 3], out)
    assert out[0].status_code >= 500
    assert time.monotonic() - t0 < 10.0


def test_a_second_prompt_for_the_same_room_replaces_the_first(peer: tuple[int, int]) -> None:
    bport, hport = peer
    first: list[httpx.Response] = []
    t = threading.Thread(target=_post, args=(hport, bport, 777, [1, 2, 3], first))
    t.start()
    time.sleep(0.5)
    second: list[httpx.Response] = []
    t0 = time.monotonic()
    _post_thread = threading.Thread(target=_post, args=(hport, bport, 777, [4, 5, 6], second))
    _post_thread.start()
    t.join(10)
    assert first and first[0].status_code >= 500 and "replaced" in first[0].text
    assert time.monotonic() - t0 < 2.0  # answered at once, not at the match timeout
    _post_thread.join(10)
