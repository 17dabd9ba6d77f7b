"""The real router (PD mode: smg 1.13, and sglang-router 0.3.2) in front of two API servers with
FakeBackends.

Checks the seams the router depends on: registration (incl. its HTTP/2 gRPC probe), the same
body with bootstrap fields to both workers, the decode answer relayed for all three endpoints,
SSE relayed, a 400 passed through with our message, a client leaving mid-stream aborts the
decode request, the router's /flush_cache fans out to both workers, its /get_loads reads our
/get_load (sglang-router) or /v1/loads (smg), and an extra output we do not produce is a 400.
Runs in a loopback-only user+network namespace (`unshare -rn`), so the router can reach
nothing else.

Run by hand: `unshare -rn python -m tests.unit.io.test_api_router [smg|sglang-router]` prints
the results.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from decode_worker.daemon.shared.router import MODULES, PACKAGES, SGLANG_ROUTER, SMG

ROOT = Path(__file__).resolve().parents[3]
PREFILL, DECODE, ROUTER, PROM = 41101, 41102, 41100, 41109
KINDS = [SMG, SGLANG_ROUTER]


def _can_run(kind: str) -> str | None:
    if importlib.util.find_spec(PACKAGES[kind]) is None:
        return f"{kind} is not installed (pip install -e '.[test]')"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.decode().strip()}"
    return None


def _drive(kind: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["unshare", "-rn", sys.executable, "-m", "tests.unit.io.test_api_router", kind],
        cwd=ROOT, capture_output=True, timeout=120, check=False, text=True,
    )


@pytest.fixture(scope="module")
def drives() -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]] | str]]:
    """kind -> its driver run, both started as the module starts (each in a network namespace
    of its own, so their fixed ports do not meet), or why it cannot run."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {kind: _can_run(kind) or pool.submit(_drive, kind) for kind in KINDS}


@pytest.mark.router
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_router_pd_mode_drives_our_api_unchanged(
        kind: str, drives: dict[str, Future[subprocess.CompletedProcess[str]] | str]) -> None:
    run = drives[kind]
    if isinstance(run, str):
        pytest.skip(run)
    out = run.result()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["healthy"] == 2
    assert res["generate"]["text"] == "Hell"
    assert res["generate"]["meta_info"]["cached_tokens"] == 2
    assert res["stream"][-1] == "[DONE]" and res["stream"][-2]["text"] == "Hel"
    assert res["chat"]["choices"][0]["message"]["content"] == "Hell"
    assert res["completions"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert res["bad"][0] == 400 and "top_p" in res["bad"][1]
    for role in ("prefill", "decode"):  # both saw every request, with the bootstrap fields
        seen = res["seen"][role]
        assert len(seen) == 5 and all(s["port"] == 8998 and s["room"] for s in seen)
    assert [s["room"] for s in res["seen"]["prefill"]] == [s["room"] for s in res["seen"]["decode"]]
    assert res["seen"]["decode"][2]["max_new_tokens"] == 4  # chat max_tokens, renamed by router
    assert res["aborts"] == ["client_abort"]  # the router closed its decode connection
    status, text = res["boom"]  # an error after the stream started: a relayed SSE error event
    assert status == 200 and '"reason":"kv_timeout"' in text and text.endswith("data: [DONE]\n\n")
    status, text = res["flush"]  # the router's /flush_cache reached both workers, both said 200
    assert status == 200 and json.loads(text)["workers_flushed"] == 2, text
    assert res["flushes"] == {"prefill": 1, "decode": 1}
    status, text = res["hidden"]  # smg sends return_hidden_states=false; true is refused
    assert status == 400 and "return_hidden_states" in text, text
    status, text = res["loads"]
    assert status == 200, text
    if kind == SGLANG_ROUTER:  # the router parsed our /get_load: the sum of num_tokens
        loads = {w["worker"].rsplit(":", 1)[1]: w["load"] for w in json.loads(text)["workers"]}
        assert loads == {str(PREFILL): 11, str(DECODE): 7}, text
    else:  # smg polled our /v1/loads: the tokens in use and the decode queue per worker
        rows = {w["worker"].rsplit(":", 1)[1]: w for w in json.loads(text)["loads"]}
        assert {k: w["num_used_tokens"] for k, w in rows.items()} == {
            str(PREFILL): 11, str(DECODE): 7}, text
        assert rows[str(DECODE)]["token_usage"] == pytest.approx(0.007), text
        assert rows[str(DECODE)]["disagg_mode"] == "decode", text


# -- driver (runs inside the namespace) ------------------------------------------------------

def _stub(port: int, role: str, model_dir: str, log_path: str) -> None:
    from decode_worker.daemon.shared.http_server import HttpServer, ServerConfig, run
    from decode_worker.io.api import ApiApp, ApiConfig
    from tests.fakes.fake_backend import FakeBackend

    class Logged(FakeBackend):
        def generate(self, inp: Any) -> Any:
            with open(log_path, "a") as f:
                f.write(json.dumps({"room": inp.bootstrap_room, "port": inp.bootstrap_port,
                                    "max_new_tokens": inp.sampling.max_new_tokens}) + "\n")
            if inp.extra.get("client_rid") == "boom" and role == "decode":
                return self._boom(inp)
            return super().generate(inp)

        async def _boom(self, inp: Any) -> Any:
            from decode_worker.io.api.backend import OutputChunk

            yield OutputChunk(token_ids=[72], prompt_tokens=2)
            await asyncio.sleep(0.05)
            yield OutputChunk(error="KV never arrived", error_status=500, error_code="kv_timeout")

        def abort(self, rid: str, reason: str) -> None:
            with open(log_path, "a") as f:
                f.write(json.dumps({"abort": reason}) + "\n")
            super().abort(rid, reason)

        async def flush_cache(self) -> Any:
            with open(log_path, "a") as f:
                f.write(json.dumps({"flush": True}) + "\n")
            return await super().flush_cache()

    async def main() -> None:
        from decode_worker.io.api.backend import Load

        if role == "prefill":  # answers at once, as a prefill peer should (the router
            # relays the decode stream only after the prefill response is complete)
            be = Logged(chunk_tokens=1 << 20, cached_tokens=2, model_path=model_dir)
        else:
            be = Logged(delay_s=0.01, cached_tokens=2, model_path=model_dir)
        used = 11 if role == "prefill" else 7
        be.load_state = Load(num_running_reqs=1, num_tokens=used, num_used_tokens=used)
        be.server_extra = {"max_total_num_tokens": 1000}
        server = HttpServer(ApiApp(be, ApiConfig()), ServerConfig(port=port))
        await server.start()
        await asyncio.Event().wait()

    run(main())


def _driver(kind: str) -> dict[str, Any]:
    import httpx

    from decode_worker.device.default_model import byte_tokenizer

    subprocess.run(["ip", "link", "set", "lo", "up"], check=False, capture_output=True)
    tmp = Path(tempfile.mkdtemp(prefix="router-"))
    (tmp / "model").mkdir()
    byte_tokenizer().save(str(tmp / "model" / "tokenizer.json"))
    me = [sys.executable, "-m", "tests.unit.io.test_api_router", "--stub"]
    procs = [subprocess.Popen([*me, str(port), role, str(tmp / "model"), str(tmp / f"{role}.log")],
                              cwd=ROOT)
             for port, role in ((PREFILL, "prefill"), (DECODE, "decode"))]
    procs.append(subprocess.Popen([
        sys.executable, "-m", MODULES[kind], "--pd-disaggregation",
        "--prefill", f"http://127.0.0.1:{PREFILL}", "8998", "--decode", f"http://127.0.0.1:{DECODE}",
        "--host", "127.0.0.1", "--port", str(ROUTER), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(PROM), "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", "3", "--request-timeout-secs", "20",
        "--policy", "round_robin", "--disable-circuit-breaker",
        *(["--load-monitor-interval", "1"] if kind == SMG else []),
    ], stdout=subprocess.DEVNULL, stderr=open(tmp / "router.err", "w")))  # noqa: SIM115
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{ROUTER}", timeout=15) as c:
            return _exercise(c, tmp)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def _exercise(c: Any, tmp: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"healthy": 0}
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and res["healthy"] < 2:
        time.sleep(0.5)
        try:
            res["healthy"] = c.get("/workers").text.count('"is_healthy":true')
        except Exception:  # the router is still starting
            continue
    msgs = [{"role": "user", "content": "hi"}]
    model = str(tmp / "model")  # the served name: the model path by default (SGLang's)
    res["generate"] = c.post("/generate", json={
        "text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    text = c.post("/generate", json={"text": "hi", "stream": True,
                                     "sampling_params": {"max_new_tokens": 3}}).text
    res["stream"] = [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:])
                     for b in text.split("\n\n") if b.startswith("data: ")]
    res["chat"] = c.post("/v1/chat/completions", json={
        "model": model, "messages": msgs, "max_tokens": 4, "temperature": 0}).json()
    res["completions"] = c.post("/v1/completions", json={
        "model": model, "prompt": "hi", "max_tokens": 3}).json()
    bad = c.post("/generate", json={"text": "hi", "sampling_params": {"top_p": 0}})
    res["bad"] = [bad.status_code, bad.text]
    hidden = c.post("/generate", json={"text": "hi", "return_hidden_states": True})
    res["hidden"] = [hidden.status_code, hidden.text]
    boom = c.post("/generate", json={"text": "hi", "stream": True, "rid": "boom",
                                     "sampling_params": {"max_new_tokens": 3}})
    res["boom"] = [boom.status_code, boom.text]
    with c.stream("POST", "/generate", json={"text": "hi", "stream": True,
                                             "sampling_params": {"max_new_tokens": 2000}}) as r:
        next(r.iter_bytes())  # then the client goes away mid-stream
    time.sleep(1.5)
    flushed = c.post("/flush_cache")  # the router sends it on to every worker
    res["flush"] = [flushed.status_code, flushed.text]
    loads = c.get("/get_loads")  # the router asks every worker's /get_load
    res["loads"] = [loads.status_code, loads.text]
    seen = {role: [json.loads(x) for x in (tmp / f"{role}.log").read_text().splitlines()]
            for role in ("prefill", "decode")}
    res["seen"] = {role: [e for e in v if "room" in e][:5] for role, v in seen.items()}
    res["aborts"] = [e["abort"] for e in seen["decode"] if "abort" in e]
    res["flushes"] = {role: sum("flush" in e for e in v) for role, v in seen.items()}
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    if sys.argv[1:2] == ["--stub"]:
        _stub(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    else:
        print(json.dumps(_driver(sys.argv[1] if len(sys.argv) > 1 else SMG)))
