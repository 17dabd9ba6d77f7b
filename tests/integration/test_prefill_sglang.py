"""`decode-worker prefill --protocol sglang` feeding SGLang 0.5.23's own decode side.

Our prefill runs as a real process; SGLang's decode (`NixlKVManager(DECODE)`, `NixlKVReceiver`,
its `SWAKVPool` and `MetadataBuffers`) runs in the SGLang venv (tests/interop/sglang_prefill/
decode_probe.py) and is driven line by line. The test plays the router: `POST /generate` with
bootstrap_host/port/room to our prefill while the decode side sends its TransferInfo. The KV
that lands in SGLang's pools must equal what our model's prefill computes (reference computed
here), bit for bit; the first token and its logprob in SGLang's aux buffers must equal ours.
Skipped without `.venv-sglang` (scripts/setup_sglang.sh). Ports: 18400-18489.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from decode_worker.daemon.prefill.main import build_runner
from decode_worker.device.runner import ModelRunner
from decode_worker.settings import load_settings
from decode_worker.utils.mathx import cdiv
from tests.integration.conftest import PeerLaunch, stop
from tests.interop.sglang_peer import venv_python

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
VENV_PY = venv_python()  # SGLANG_VENV, default .venv-sglang
PROBE = ROOT / "tests" / "interop" / "sglang_prefill" / "decode_probe.py"
GOLDEN = ROOT / "tests" / "data" / "sglang_frames"
HTTP_PORT, BOOT_PORT, RANK_PORT, PROBE_PORT = 18400, 18401, 18402, 18403
PROBE_ENV = {"SGLANG_CPU_ZMQ_PORTS": "18410-18429", "UCX_TCP_PORT_RANGE": "18430-18459"}
PREFILL_ENV = {"UCX_TCP_PORT_RANGE": "18460-18489", "UCX_NET_DEVICES": "lo"}
PS, WINDOW, SENTINEL = 16, 127, 12345.0
STATE_MISMATCH = "State index length mismatch at component 0: prefill={}, dst={}"

if VENV_PY is None:
    pytest.skip("no SGLang venv (bash scripts/setup_sglang.sh)", allow_module_level=True)


class Probe:
    """decode_probe.py under the venv: one JSON command per line, one `PROBE` reply each."""

    def __init__(self, dump_dir: Path) -> None:
        cmd = [str(VENV_PY), str(PROBE), "--bootstrap-addr", f"127.0.0.1:{BOOT_PORT}",
               "--own-port", str(PROBE_PORT), "--dump-dir", str(dump_dir), "--dtype", "float32",
               "--pool-tokens", "16384", "--swa-pool-tokens", "16384"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, **PROBE_ENV, "OMP_NUM_THREADS": "1"})
        self.lines: list[str] = []
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self.lines.append(line)
            if line.startswith("PROBE "):
                self.replies.put(json.loads(line[6:]))

    def next_reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self.replies.get(timeout=timeout_s)
        except queue.Empty:
            tail = "".join(self.lines[-30:])
            raise AssertionError(f"decode probe silent for {timeout_s:.0f} s:\n{tail}") from None

    def call(self, timeout_s: float = 90.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self.next_reply(timeout_s)
        assert reply["ok"], reply
        return reply

    def stop(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class Reference:
    """Our model's own prefill, in this process, into fresh pages of its own pools."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.next_page = runner, 1
        n = len(runner.model.cfg.layer_types)
        self.swa_layers = {i for i in range(n) if runner.pools.layer_slot(i)[0] == "swa"}

    def run(self, prompt: list[int]) -> tuple[dict[int, torch.Tensor], int, float]:
        """(layer -> K/V rows [2, L, heads, head_dim], greedy first token, its logprob)."""
        n = cdiv(len(prompt), PS)
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        logits = self.runner.prefill(prompt, pages, pages)
        pools, rows = self.runner.pools, {}
        for layer in range(len(self.runner.model.cfg.layer_types)):
            pool, index = pools.layer_slot(layer)
            t = pools.tensor(pool)[index, pages]  # [n, 2, PS, heads, hd]
            rows[layer] = t.permute(1, 0, 2, 3, 4).flatten(1, 2)[:, : len(prompt)]
        token = int(torch.argmax(logits))
        return rows, token, float(torch.log_softmax(logits.float(), -1)[token])


@pytest.fixture(scope="module")
def rig(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probe]:
    """Our prefill (sglang protocol) and SGLang's decode side, started together."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in PREFILL_ENV.items():
            mp.setenv(key, value)
        peer = PeerLaunch(BOOT_PORT, model_cache, "--protocol", "sglang", "--set",
                          f"transfer.prefill_rank_port={RANK_PORT}", "--set",
                          "scheduler.kv_timeout_s=20", http_port=HTTP_PORT)
    probe = Probe(tmp_path_factory.mktemp("sglang-dumps"))
    try:
        peer.ready(timeout_s=120)
        ready = probe.next_reply(timeout_s=180)
        assert ready.get("event") == "ready", ready
        yield probe
    finally:
        probe.stop()
        stop(peer.proc)


@pytest.fixture(scope="module")
def reference(model_cache: Path) -> Reference:
    s = load_settings(overrides={"model.cache_dir": str(model_cache), "cache.num_full_pages": 512,
                                 "cache.num_swa_pages": 512}).settings  # fmt: skip
    return Reference(build_runner(s)[0])


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def generate(prompt: list[int], room: int) -> tuple[int, dict[str, Any]]:
    """The router's request to our prefill: (HTTP status, JSON body)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 5, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": BOOT_PORT, "bootstrap_room": room}
    req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}/generate",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def check_landed(dump: dict[str, np.ndarray], ref: Reference, rows: dict[int, torch.Tensor],
                 prompt_len: int, prefix_len: int) -> None:
    """Full layers: [P, L) equal ours, [0, P) never written; SWA layers: SGLang's window."""
    ws = max(prefix_len, prompt_len - WINDOW) // PS * PS
    assert int(dump["swa_start"]) == ws
    for layer, want in rows.items():
        got = torch.stack([torch.from_numpy(dump[f"{kv}{layer}"]) for kv in "kv"])
        if layer in ref.swa_layers:  # positions [ws, L)
            assert torch.equal(got, want[:, ws:]), f"layer {layer}: SWA window differs"
            continue
        assert torch.equal(got[:, prefix_len:], want[:, prefix_len:]), f"layer {layer} differs"
        assert bool((got[:, :prefix_len] == SENTINEL).all()), f"layer {layer}: prefix written"


def check_aux(aux: dict[str, Any], body: dict[str, Any], room: int, token: int,
              logprob: float) -> None:
    meta = body["meta_info"]
    (lp, tok, _), = meta["output_token_logprobs"]
    assert aux["first_token"] == body["output_ids"][0] == tok == token
    assert aux["logprob_idx"] == token and aux["bootstrap_room"] == room
    assert aux["logprob"] == f32(lp) and abs(aux["logprob"] - logprob) < 1e-4
    top = meta["output_top_logprobs"][0]
    assert aux["top_logprobs_idx"][:5] == [t for _, t, _ in top]
    assert aux["top_logprobs_val"][:5] == [f32(v) for v, _, _ in top]
    assert aux["cached_tokens"] == 0


def run_room(probe: Probe, prompt: list[int], room: int, prefix_len: int = 0,
             info_first: bool = False, swa_page_delta: int = 0) -> tuple[dict[str, Any], ...]:
    """One room as the router and SGLang's decode drive it: (wait reply, HTTP status, body)."""
    with ThreadPoolExecutor(1) as pool:
        http: Future[tuple[int, dict[str, Any]]] | None = None
        if not info_first:
            http = pool.submit(generate, prompt, room)
            time.sleep(0.2)  # the prompt is in before the TransferInfo
        probe.call(op="receive", room=room, seq_len=len(prompt), prefix_len=prefix_len,
                   swa_page_delta=swa_page_delta)
        if http is None:
            time.sleep(0.2)  # the TransferInfo is in before the prompt
            http = pool.submit(generate, prompt, room)
        done = probe.call(op="wait", room=room, timeout_s=30)
        status, body = http.result(timeout=60)
    return done, {"status": status}, body


def test_golden_server_info_from_the_live_bootstrap_server(rig: Probe) -> None:
    path = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    with urllib.request.urlopen(f"http://127.0.0.1:{BOOT_PORT}{path}", timeout=10) as resp:
        raw = resp.read()
    want = json.loads((GOLDEN / "route_server_info.http.json").read_text())["body"]
    assert raw == json.dumps({**want, "prefill_http_port": HTTP_PORT}).encode()


@pytest.mark.parametrize("info_first", [False, True], ids=["prompt-first", "info-first"])
def test_sglang_decode_lands_exactly_our_prefill_kv(
        rig: Probe, reference: Reference, info_first: bool) -> None:
    prompt, room = prompt_of(300, seed=1 + info_first), 7001 + info_first
    done, http, body = run_room(rig, prompt, room, info_first=info_first)
    assert done["status"] == "success", done
    assert http["status"] == 200, body
    rows, token, logprob = reference.run(prompt)
    with np.load(done["dump"]) as dump:
        check_landed(dict(dump), reference, rows, len(prompt), 0)
    check_aux(done["aux"], body, room, token, logprob)


@pytest.mark.parametrize(("length", "prefix"), [(400, 64), (200, 160), (256, 256)])
def test_decode_prefix_sends_only_the_suffix_and_the_window(
        rig: Probe, reference: Reference, length: int, prefix: int) -> None:
    """P = decode_prefix_len: KV of [P, L) only; SWA from floor(max(P, L - 127)). P = L (a full
    hit as SGLang's decode sends it: no KV ids, an empty state list): the aux row only."""
    prompt, room = prompt_of(length, seed=length), 7100 + prefix
    done, http, body = run_room(rig, prompt, room, prefix_len=prefix)
    assert done["status"] == "success" and http["status"] == 200, (done, body)
    rows, token, logprob = reference.run(prompt)
    with np.load(done["dump"]) as dump:
        check_landed(dict(dump), reference, rows, length, prefix)
    check_aux(done["aux"], body, room, token, logprob)


def test_abort_gets_an_abort_ack_and_fails_the_prefill_request(rig: Probe) -> None:
    prompt, room = prompt_of(64, seed=9), 7200
    rig.call(op="receive", room=room, seq_len=len(prompt))
    aborted = rig.call(op="abort", room=room, timeout_s=10)
    assert aborted["acked"], aborted
    assert aborted["elapsed_s"] < 2.0
    start = time.monotonic()
    status, body = generate(prompt, room)  # the router's request, after the decode gave up
    assert status == 502 and "Aborted by decode-side abort notification." in json.dumps(body)
    assert time.monotonic() - start < 5.0


def test_abort_mid_prefill_is_acked_once_nothing_is_in_flight(rig: Probe) -> None:
    """ABORT while the room computes (4000 tokens: about 2 s here): the ABORT_ACK waits for the
    room's WRITEs to settle; the prefill request fails with SGLang's abort reason."""
    prompt, room = prompt_of(4000, seed=13), 7250
    rig.call(op="receive", room=room, seq_len=len(prompt))
    with ThreadPoolExecutor(1) as pool:
        http = pool.submit(generate, prompt, room)
        deadline = time.monotonic() + 10
        while running_requests() == 0:  # our prefill has the prompt: the room has started
            assert time.monotonic() < deadline, "the prefill request never arrived"
            time.sleep(0.01)
        time.sleep(0.1)
        aborted = rig.call(op="abort", room=room, timeout_s=20)
        status, body = http.result(timeout=60)
    assert aborted["acked"], aborted
    assert aborted["elapsed_s"] > 0.3, aborted  # not acked before the prefill ended
    assert status == 502 and "Aborted by decode-side abort notification." in json.dumps(body)


def running_requests() -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/get_load", timeout=10) as resp:
        load = json.loads(resp.read())
    return int((load[0] if isinstance(load, list) else load)["num_reqs"])


def test_state_index_count_mismatch_fails_with_sglangs_message(rig: Probe) -> None:
    """One SWA page more than SGLang's window: KV_STATUS Failed, SGLang's own reason text."""
    prompt, room = prompt_of(200, seed=11), 7300
    done, http, body = run_room(rig, prompt, room, swa_page_delta=1)
    n = cdiv(200 - (200 - WINDOW) // PS * PS, PS)
    want = STATE_MISMATCH.format(n, n + 1)
    assert done["status"] == "failed" and want in (done["reason"] or ""), done
    assert http["status"] == 502 and want in json.dumps(body)
