"""SGLang 0.5.23's own prefill code feeds a real `decode-worker serve`.

The prefill side is tests/interop/sglang_prefill/ under the SGLang venv (scripts/setup_sglang.sh;
the test skips without it): SGLang's bootstrap server, `NixlKVManager(PREFILL)`, a `NixlKVSender`
per room, a real `SWAKVPool` and `MetadataBuffers` on the CPU, holding transformers' real prefill
of the tiny gpt-oss (`kv: "model"`: post-RoPE K/V of every layer, the greedy first token and its
logprobs in SGLang's aux row). It never imports decode_worker. The test plays the router: the same
room goes to the harness (POST /prefill) and to the worker (POST /generate with bootstrap_host,
bootstrap_port, bootstrap_room); the worker runs with `transfer.peer_protocol=auto` and must find
out by itself that the peer speaks SGLang's protocol.

Checked: greedy tokens, logprobs and top logprobs equal transformers' own, with prefill TP 1 and
TP 2 (two registrations; each rank writes its KV head); turns >= 2 of a conversation report
cached tokens (and the prefill saw a decode prefix), also from the host tier of a second worker
whose device pool is too small for the conversations; a room the prefill fails ends in 502 naming
the peer's reason, and the rank that failed it gets no ABORT, so SGLang keeps its own cause (TP 1
and TP 2, the client answered or gone); a page-aligned prompt sent twice (the worker holds it
in full the second time) is answered exactly both times; a killed prefill fails its request
(502, peer_dead) within seconds; after each failure the worker is idle with every page back and
keeps serving.

Ports: 18500-18599 only (both harnesses' HTTP, ZMQ and UCX ranges, and the worker's).
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from decode_worker.daemon.shared.procs import ServerProcess
from decode_worker.device.default_model import write_model
from tests.e2e.live_fixtures import Live, gen_body
from tests.interop.pd import (
    MAX_NEW,
    PAGE_SIZE,
    PEER_DEAD_AFTER_S,
    PYTHON,
    assert_idle_and_whole,
    check_against_reference,
    conversation,
    needs_sglang_venv,
    pd_body,
    pd_request,
    worker_args,
)
from tests.interop.sglang_peer import TERMINAL, HarnessPorts, SglangPrefill

pytestmark = [pytest.mark.slow, needs_sglang_venv]

TP1 = HarnessPorts(18500, 18501, "18510-18519", "18520-18539")
TP2 = HarnessPorts(18502, 18503, "18540-18549", "18550-18569")
WORKER_UCX = "18570-18579"
WORKER_PORT = 18590
TIGHT_UCX = "18580-18589"
TIGHT_PORT = 18591
# a device pool that holds about two of three interleaved chats: the host tier carries the rest
TIGHT_POOL = ["--set", "cache.num_full_pages=32", "--set",
              "scheduler.integrity_check_interval_s=0.1"]


@dataclass
class Rig:
    tp1: SglangPrefill  # prefill attention TP 1
    tp2: SglangPrefill  # prefill attention TP 2
    worker: Live
    tight: Live  # a second worker whose device pool is too small for the conversations
    reference: Any  # transformers' GptOssForCausalLM, float32


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Both harnesses and the worker, started at once (the harnesses take 10-25 s to import).

    The TP 2 harness builds both ranks' managers in one process (`--tp-in-process`: each rank
    its own NIXL agent, ZMQ socket and registration, as the decode sees two processes); one
    process per rank doubles its start-up on 2 cores (26 -> 52 s measured) for the same wire.
    """
    transformers = pytest.importorskip("transformers")
    assert PYTHON is not None
    model_dir = write_model(tmp_path_factory.mktemp("sglang-interop") / "tiny-gpt-oss", seed=0)
    harness_args = ["--model", str(model_dir), "--page-size", str(PAGE_SIZE)]
    tp1 = SglangPrefill(PYTHON, TP1, harness_args).start()
    tp2 = SglangPrefill(PYTHON, TP2, [*harness_args, "--tp-size", "2", "--tp-in-process"]).start()
    proc = ServerProcess("decode", worker_args(model_dir, WORKER_PORT), WORKER_PORT,
                         env={"UCX_TCP_PORT_RANGE": WORKER_UCX})
    tight_proc = ServerProcess("decode-tight", [*worker_args(model_dir, TIGHT_PORT),
                                                *TIGHT_POOL], TIGHT_PORT,
                               env={"UCX_TCP_PORT_RANGE": TIGHT_UCX})
    try:
        with proc, tight_proc:
            ref = transformers.GptOssForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            proc.wait_ready(120)
            tight_proc.wait_ready(120)
            tp1.wait_ready()
            tp2.wait_ready()
            worker, tight = Live(proc), Live(tight_proc)
            try:
                yield Rig(tp1, tp2, worker, tight, ref.eval())
            finally:
                worker.close()
                tight.close()
    finally:
        tp1.kill()
        tp2.kill()
        proc.log.close()
        tight_proc.log.close()


def assert_peers_speak_sglang(worker: Live, at_least: int, timeout_s: float = 5.0) -> None:
    """/metrics counts the harnesses as SGLang peers (auto found out), none as native."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = worker.metrics()
        peers = {p: m.value("decode_worker_transfer_peers", protocol=p)
                 for p in ("sglang", "native")}
        if peers["sglang"] >= at_least and peers["native"] == 0:
            return
        assert time.monotonic() < deadline, f"peers by protocol: {peers}"
        time.sleep(0.1)


@pytest.mark.parametrize("tp", [1, 2])
def test_multi_turn_conversation_matches_reference(rig: Rig, tp: int) -> None:
    harness = rig.tp1 if tp == 1 else rig.tp2
    history: list[int] = []
    cached, prefixes = [], []
    for turn, user in enumerate(conversation(seed=tp)):
        prompt = history + user
        resp, state = pd_request(harness, rig.worker, prompt)
        assert resp.status_code == 200, f"turn {turn}: {resp.text[:2000]}"
        assert state["status"] == "success", f"turn {turn}: prefill side {state}\n" + (
            harness.output()[-3000:])
        assert len(state["ranks"]) == tp
        out = resp.json()
        check_against_reference(rig.reference, prompt, out)
        cached.append(out["meta_info"]["cached_tokens"])
        prefixes.append(min(r["decode_prefix_len"] for r in state["ranks"]))
        history = prompt + out["output_ids"]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), f"cached tokens: {cached}"
    assert prefixes[0] == 0 and all(p > 0 for p in prefixes[1:]), f"decode prefix: {prefixes}"
    assert_idle_and_whole(rig.worker)
    assert_peers_speak_sglang(rig.worker, tp)


def test_a_page_aligned_prompt_sent_twice_is_answered_exactly_the_second_time(rig: Rig) -> None:
    """A retry: the second time the worker holds the whole prompt (whole pages). SGLang's
    sender would send no SWA at decode_prefix_len = L, so the worker asks below L (as SGLang's
    own decode does): the window and the first token arrive, and the answer equals
    transformers' both times."""
    harness, first = rig.tp1, conversation(seed=31, turns=1)[0]
    prompt = first[: len(first) - len(first) % PAGE_SIZE]
    prefixes, cached = [], []
    for attempt in range(2):
        resp, state = pd_request(harness, rig.worker, prompt)
        assert resp.status_code == 200, f"attempt {attempt}: {resp.text[:2000]}"
        assert state["status"] == "success", state
        out = resp.json()
        check_against_reference(rig.reference, prompt, out)
        prefixes.append(state["ranks"][0]["decode_prefix_len"])
        cached.append(out["meta_info"]["cached_tokens"])
    assert len(prompt) % PAGE_SIZE == 0 and prefixes[0] == cached[0] == 0
    assert 0 < prefixes[1] == cached[1] < len(prompt), (len(prompt), prefixes, cached)
    print(f"\nL={len(prompt)}: decode_prefix_len {prefixes}, cached tokens {cached}")
    assert_idle_and_whole(rig.worker)


def test_conversations_beyond_the_device_pool_restore_host_hits_exactly(rig: Rig) -> None:
    """Three chats, one turn of each in turn, from SGLang's own sender into a worker whose
    device pool holds about two: each chat's earlier turns are demoted to the host tier and
    restored for its next turn (advertised to SGLang as decode prefix); every answer equals
    transformers' (restored KV is bit-exact), and once idle every page is back."""
    worker, harness = rig.tight, rig.tp1
    chats = [conversation(seed=20 + c) for c in range(3)]
    history: list[list[int]] = [[] for _ in chats]
    prefixes: dict[int, list[int]] = {c: [] for c in range(len(chats))}
    for turn in range(3):
        for c, users in enumerate(chats):
            prompt = history[c] + users[turn]
            resp, state = pd_request(harness, worker, prompt)
            assert resp.status_code == 200, f"chat {c} turn {turn}: {resp.text[:2000]}"
            assert state["status"] == "success", state
            out = resp.json()
            check_against_reference(rig.reference, prompt, out)
            assert (out["meta_info"]["cached_tokens"] > 0) == (turn > 0), (c, turn)
            prefixes[c].append(state["ranks"][0]["decode_prefix_len"])
            history[c] = prompt + out["output_ids"]
    assert all(p[0] == 0 and all(x > 0 for x in p[1:]) for p in prefixes.values()), prefixes
    assert_idle_and_whole(worker)
    m = worker.metrics()
    hits = m.value("decode_worker_prefix_cache_host_hit_tokens_total")
    assert hits > 0 and m.value("decode_worker_kv_host_restored_tokens_total") == hits
    assert m.pool("host")["protected"] == 0, m.pool("host")
    assert_peers_speak_sglang(worker, 1)


def test_failed_room_answers_502_with_the_peer_reason(rig: Rig) -> None:
    prompt = conversation(seed=11, turns=1)[0]
    reason = f"interop: NIXL write failed, room tag {random.getrandbits(32):08x}"
    resp, state = pd_request(rig.tp1, rig.worker, prompt, fail="status", fail_reason=reason)
    assert resp.status_code == 502, resp.text[:2000]
    assert reason in resp.text, resp.text[:2000]
    assert state["status"] == "failed", state
    assert_idle_and_whole(rig.worker)
    resp, state = pd_request(rig.tp1, rig.worker, prompt)  # the same peer, served again
    assert resp.status_code == 200, resp.text[:2000]
    check_against_reference(rig.reference, prompt, resp.json())


def test_a_door_refusal_fails_the_room_at_sglangs_prefill_at_once(rig: Rig) -> None:
    """The worker refuses the request at its door (a 400: a bad sampling value; the prefill
    does not see the worker's body): SGLang's prefill ranks get `ABORT room` and mark the room
    failed now, not at their timeout (30 s here); the worker counts the refusal."""
    harness, prompt = rig.tp1, conversation(seed=13, turns=1)[0]
    room = random.getrandbits(63)
    harness.prefill({"room": room, "input_ids": prompt, "kv": "model", "timeout_s": 30})
    state = harness.wait_room(room, ("bootstrapping", "waiting_for_input", *TERMINAL), 20)
    assert state["status"] in ("bootstrapping", "waiting_for_input"), state
    before = rig.worker.metrics().value("decode_worker_aborts_total", reason="bad_request")
    body = gen_body(prompt, MAX_NEW, bootstrap_host="127.0.0.1",
                    bootstrap_port=harness.ports.bootstrap, bootstrap_room=room)
    body["sampling_params"]["temperature"] = -1.0
    refused_at = time.monotonic()
    resp = rig.worker.post("/generate", body, timeout_s=30)
    assert resp.status_code == 400, resp.text[:2000]
    state = harness.wait_room(room, TERMINAL, 10)
    took = time.monotonic() - refused_at
    assert state["status"] == "failed" and "abort" in str(state["reason"]).lower(), state
    assert took < 5.0, f"the room failed {took:.1f}s after the refusal"
    after = rig.worker.metrics().value("decode_worker_aborts_total", reason="bad_request")
    assert after == before + 1
    assert_idle_and_whole(rig.worker)


def _post_then_leave(worker: Live, body: dict[str, Any], leave: Any) -> None:
    """POST /generate on a raw connection, call `leave()` (it returns once it is time to go),
    then close the connection without reading: a client that disconnects."""
    payload = json.dumps(body).encode()
    port = int(worker.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        leave()


def _wait_rank_failed(harness: SglangPrefill, room: int, timeout_s: float = 15.0) -> None:
    """Return once prefill rank 0 has failed `room` itself (its sender concluded Failed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = harness.room(room)
        if state is not None and state["ranks"][0] and state["ranks"][0]["status"] == "failed":
            return
        time.sleep(0.005)
    raise AssertionError(f"room {room}: rank 0 did not fail within {timeout_s} s")


def _transfer_failures(worker: Live) -> float:
    return worker.metrics().value("decode_worker_transfer_failures_total",
                                  reason="transfer_failed")


def _wait_worker_saw_failure(harness: SglangPrefill, worker: Live, room: int, before: float,
                             timeout_s: float = 15.0) -> None:
    """Return once prefill rank 0 failed `room` and the worker counted the failed transfer:
    a client that leaves before the worker has the rank's status makes the worker ABORT the
    rank (it cannot know yet), a different case from the one checked here."""
    _wait_rank_failed(harness, room, timeout_s)
    deadline = time.monotonic() + timeout_s
    while _transfer_failures(worker) <= before:
        assert time.monotonic() < deadline, f"room {room}: the worker never saw rank 0 fail"
        time.sleep(0.005)


@pytest.mark.parametrize("tp, disconnect", [(1, False), (1, True), (2, False), (2, True)],
                         ids=["tp1-answered", "tp1-client-left", "tp2-answered",
                              "tp2-client-left"])
def test_a_room_the_prefill_failed_keeps_the_prefills_cause(rig: Rig, tp: int,
                                                            disconnect: bool) -> None:
    """SGLang's transfer worker fails the room itself (a status failure with its reason, or
    its own state / page count mismatch), several times in a row: the worker answers 502 with
    that reason (or the client leaves once the worker has the failed rank's status), and sends
    the rank that failed no ABORT (SGLang's manager counts none), so the cause SGLang records
    for the room, read afterwards, stays the prefill's own every time. TP 2: rank 0 fails, rank
    1 serves after a delay; rank 1, which had not reported, gets at most the one ABORT of the
    failed transfer (exactly one when rank 0 failed before any send), never one more from the
    request's end. A successful request over the same links afterwards orders the check: an
    ABORT sent for an earlier room would have arrived before its TransferInfo."""
    harness = rig.tp1 if tp == 1 else rig.tp2
    prompt = conversation(seed=13, turns=1)[0]
    # SGLang's own words for the extra SWA page (TP 2 to our TP 1 is its head-sliced path)
    mismatch = ("State index length mismatch" if tp == 1 else
                "Head-sliced PD transfer page count mismatch")
    rooms: dict[int, tuple[str, str]] = {}  # room -> (fail mode, the prefill's own cause)
    for i in range(8 if tp == 1 else 4):
        room = random.getrandbits(63)
        tag = f"interop: NIXL write failed, room tag {room & 0xFFFFFFFF:08x}"
        fail = {"fail": "status", "fail_reason": tag} if i % 2 else {"fail": "state_mismatch"}
        rooms[room] = (fail["fail"], tag if i % 2 else mismatch)
        spec = {"room": room, "input_ids": prompt, "kv": "model", "timeout_s": 30, **fail}
        harness.prefill({**spec, "fail_ranks": [0], "delay_s": 1.0} if tp == 2 else spec)
        body = pd_body(harness, prompt, room)
        if disconnect:
            failed = _transfer_failures(rig.worker)
            _post_then_leave(rig.worker, body,
                             lambda r=room, n=failed: _wait_worker_saw_failure(
                                 harness, rig.worker, r, n))
        else:
            resp = rig.worker.post("/generate", body, timeout_s=40)
            assert resp.status_code == 502 and rooms[room][1] in resp.text, resp.text[:2000]
    resp, _ = pd_request(harness, rig.worker, prompt)
    assert resp.status_code == 200, resp.text[:2000]
    causes = []
    for room, (mode, cause) in rooms.items():
        state = harness.wait_room(room, ("failed",), 15)
        first, *others = state["ranks"]
        causes.append(str(first["reason"]))  # SGLang's KVTransferError for the room
        assert first.get("decode_aborts", 0) == 0, (room, first)
        assert cause in causes[-1], (room, first)
        for other in others:  # not failing: ABORTed by the failed transfer, or it succeeded
            aborts = other.get("decode_aborts", 0)
            assert aborts == 1 if mode == "status" else aborts <= 1, (room, other)
    decode_side = sum("decode-side abort" in c for c in causes)
    print(f"\ntp {tp} {'client-left' if disconnect else 'answered'}: {len(rooms)} rooms the "
          f"prefill failed in a row; SGLang's recorded cause (rank 0): {decode_side} 'Aborted "
          f"by decode-side abort notification', {len(causes) - decode_side} the prefill's own: "
          + "; ".join(c.split("): ", 1)[-1][:48] for c in causes))
    assert_idle_and_whole(rig.worker)


def test_killed_prefill_fails_its_request_and_pages_come_back(rig: Rig) -> None:
    """Last in the file (it kills the TP 2 harness the module shares): the room is
    mid-transfer (the decode's TransferInfo reached both ranks, the forward "runs" for a
    minute) when every prefill process dies."""
    harness, prompt = rig.tp2, conversation(seed=12, turns=1)[0]
    room = random.getrandbits(63)
    body = gen_body(prompt, MAX_NEW, bootstrap_host="127.0.0.1",
                    bootstrap_port=harness.ports.bootstrap, bootstrap_room=room)
    harness.prefill({"room": room, "input_ids": prompt, "kv": "model", "delay_s": 60,
                     "timeout_s": 90})
    with ThreadPoolExecutor(max_workers=1) as pool:
        answer = pool.submit(rig.worker.post, "/generate", body, timeout_s=40)
        state = harness.wait_room(room, ("waiting_for_input", *TERMINAL), 20)
        assert state["status"] == "waiting_for_input", state
        killed_at = time.monotonic()
        harness.kill()
        resp = answer.result(timeout=45)
    took = time.monotonic() - killed_at
    assert resp.status_code == 502, resp.text[:2000]
    assert "peer_dead" in resp.text, resp.text[:2000]
    assert took < PEER_DEAD_AFTER_S + 4, f"answered {took:.1f}s after the kill"
    assert rig.worker.get("/health").status_code == 200
    assert_idle_and_whole(rig.worker)
