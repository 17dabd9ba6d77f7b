"""smg 1.13 in gRPC mode without a local tokenizer, and the API key on the gRPC port.

GetTokenizer: a decode worker runs from its own directory with a relative model path and smg
from another directory without `--model-path` / `--tokenizer-path`, as on two machines: the
`tokenizer_path` the worker reports does not exist for smg, so smg fetches the tokenizer
bundle with `GetTokenizer` (its log says so, the worker counts the call) and tokenizes and
detokenizes with it: its /v1/completions text equals the worker's own HTTP answer.

API key: smg 1.13 sends no credential on its gRPC calls (no `authorization` metadata; its
`--api-key` guards its own door and its HTTP workers). So a worker with `server.api_key`
enforces it on the gRPC calls that serve or change work (UNAUTHENTICATED with a message saying
what to send) and keeps the reports open, as HTTP does (checked straight with a grpc client),
and smg in front of such a worker gets its requests refused with that message. The working
deployment is `server.grpc_require_api_key=false` (the gRPC port fenced) with smg's
`--api-key`: clients need the key at smg, the worker's HTTP routes still need it.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from decode_worker.daemon.shared.harmony_vocab import harmony_vocab_env
from decode_worker.daemon.shared.procs import ServerProcess, free_port, scrape_metric
from decode_worker.daemon.shared.router import MODULES, SMG, Router, has_router
from tests.e2e.grpc_client import GrpcWorker, completes, gen_request
from tests.e2e.live_fixtures import Metrics, pool_is_whole

pytestmark = [pytest.mark.slow, pytest.mark.router,
              pytest.mark.skipif(not has_router(), reason="smg is not installed"),
              pytest.mark.skipif(not harmony_vocab_env(), reason="no o200k vocabulary for smg's "
                                 "harmony encoding (quicktok-v1 not installed)")]
KEY = "grpc-test-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
SMALL = ["--set", "cache.page_size=16", "--set", "cache.num_full_pages=256",
         "--set", "cache.num_swa_pages=64", "--set", f"server.api_key={KEY}"]
PROMPT = list(range(20, 60))
CODE = grpc.StatusCode


def _worker(name: str, model: str, cwd: Path | None, *extra: str) -> ServerProcess:
    """A decode worker on ports it binds and reports (its gRPC port: `grpc_target`, once
    ready)."""
    return ServerProcess(name, ["serve", "--port", "0", "--grpc-port", "0", "--model", model,
                                *SMALL, *extra], cwd=None if cwd is None else str(cwd))


def _smg(worker: ServerProcess, cwd: Path) -> Router:
    """smg in gRPC regular mode in front of `worker`, with `--api-key` and no tokenizer path."""
    port = free_port()
    argv = [sys.executable, "-m", MODULES[SMG], "--worker-urls", f"grpc://{worker.grpc_target}",
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
            "--health-check-interval-secs", "2", "--disable-circuit-breaker",
            "--api-key", KEY]
    return Router(argv, port, name=f"smg-{worker.name}", cwd=str(cwd))


def _ready(router: Router, timeout_s: float = 90.0) -> str:
    """smg's log once it lists a healthy worker (GET /workers needs the key too) and has
    registered a tokenizer (a background job after the worker)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = _plain(router.output())
        if "Successfully loaded tokenizer" in log and _healthy_workers(router) >= 1:
            return log
        assert router.proc is not None and router.proc.poll() is None, log[-3000:]
        assert time.monotonic() < deadline, f"smg not ready in {timeout_s}s:\n{log[-3000:]}"
        time.sleep(0.3)


def _healthy_workers(router: Router) -> int:
    try:
        status, listed = _get(f"{router.url}/workers", BEARER)
    except OSError:
        return 0
    workers = listed.get("workers", []) if status == 200 and isinstance(listed, dict) else []
    return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", True))


@pytest.fixture(scope="module")
def fenced(e2e_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[ServerProcess, Router]]:
    """A worker with an API key and `grpc_require_api_key=false` (run from a directory where
    its model is `tiny-gpt-oss`), smg with `--api-key` run from an empty directory."""
    home, elsewhere = tmp_path_factory.mktemp("worker-home"), tmp_path_factory.mktemp("smg")
    (home / "tiny-gpt-oss").symlink_to(e2e_model_dir, target_is_directory=True)
    with _worker("fenced", "tiny-gpt-oss", home,
                 "--set", "server.grpc_require_api_key=false") as worker:
        worker.wait_ready(180)
        with _smg(worker, elsewhere) as router:
            _ready(router)
            yield worker, router


@pytest.fixture(scope="module")
def strict(e2e_model_dir: Path) -> Iterator[ServerProcess]:
    """A worker that enforces its API key on gRPC too (the default)."""
    with _worker("strict", str(e2e_model_dir), None) as worker:
        worker.wait_ready(180)
        yield worker


def test_smg_fetches_the_tokenizer_bundle_from_the_worker(
        fenced: tuple[ServerProcess, Router]) -> None:
    worker, router = fenced
    log = _ready(router)
    assert f"Fetching tokenizer from worker: grpc://{worker.grpc_target}" in log
    assert scrape_metric(worker.url, "decode_worker_grpc_requests_total",
                         'code="OK",method="GetTokenizer"') >= 1
    body = {"model": "tiny-gpt-oss", "prompt": "The decode worker", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    status, via_smg = _post(f"{router.url}/v1/completions", body, BEARER)
    assert status == 200, via_smg
    _, direct = _post(f"{worker.url}/v1/completions", body, BEARER)
    assert via_smg["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via_smg["usage"]["completion_tokens"] == 8


def test_smg_asks_its_clients_for_the_key_and_the_worker_http_still_does(
        fenced: tuple[ServerProcess, Router]) -> None:
    worker, router = fenced
    body = {"model": "tiny-gpt-oss", "prompt": "hi", "max_tokens": 2}
    assert _post(f"{router.url}/v1/completions", body)[0] == 401
    assert _post(f"{worker.url}/v1/completions", body)[0] == 401


def test_the_grpc_key_guards_work_and_leaves_the_reports_open(strict: ServerProcess) -> None:
    right = [("authorization", f"Bearer {KEY}")]
    with GrpcWorker(str(strict.grpc_target)) as w:
        for metadata, says in ((None, "missing API key"),
                               ([("authorization", "Bearer nope")], "wrong API key")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                w.generate(gen_request(PROMPT, 4), metadata=metadata)
            assert info.value.code() == CODE.UNAUTHENTICATED
            assert says in info.value.details()
            assert "authorization: Bearer <server.api_key>" in info.value.details()
        out = completes(w.generate(gen_request(PROMPT, 4), metadata=right))
        assert len(out) == 1 and len(out[0].output_ids) == 4
        guarded: list[tuple[str, Any]] = [
            ("Abort", pb.AbortRequest(request_id="x")),
            ("FlushCache", common_pb2.FlushCacheRequest()),
            ("SubscribeKvEvents", common_pb2.SubscribeKvEventsRequest())]
        for method, request in guarded:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                call = w.stream if method == "SubscribeKvEvents" else w.unary
                call(method, request, 10.0)
            assert info.value.code() == CODE.UNAUTHENTICATED, method
        assert w.unary("HealthCheck", pb.HealthCheckRequest()).healthy
        assert w.unary("GetModelInfo", pb.GetModelInfoRequest()).vocab_size > 0
        assert w.unary("GetServerInfo", pb.GetServerInfoRequest()).server_type
        w.unary("GetLoads", pb.GetLoadsRequest())
        assert w.stream("GetTokenizer", common_pb2.GetTokenizerRequest())
        assert w.unary("FlushCache", common_pb2.FlushCacheRequest(), metadata=right).success
    m = _metrics(strict)
    assert m.value("decode_worker_grpc_requests_total", method="Generate",
                   code="UNAUTHENTICATED") == 2
    assert pool_is_whole(m) == []


def test_smg_in_front_of_a_strict_worker_passes_its_refusal_on(
        strict: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    """smg 1.13 sends no key over gRPC: every generation is refused with the worker's
    message, and the worker counts it."""
    before = scrape_metric(strict.url, "decode_worker_grpc_requests_total",
                           'code="UNAUTHENTICATED",method="Generate"')
    with _smg(strict, tmp_path_factory.mktemp("smg-strict")) as router:
        _ready(router)
        status, answer = _post(f"{router.url}/v1/completions",
                               {"model": strict.args[strict.args.index("--model") + 1],
                                "prompt": "hi", "max_tokens": 2}, BEARER)
    assert status == 401 and "grpc_require_api_key" in json.dumps(answer), (status, answer)
    assert scrape_metric(strict.url, "decode_worker_grpc_requests_total",
                         'code="UNAUTHENTICATED",method="Generate"') >= before + 1


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> tuple[int, Any]:
    return _call(urllib.request.Request(url, json.dumps(body).encode(), {
        "Content-Type": "application/json", **(headers or {})}))


def _get(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    return _call(urllib.request.Request(url, headers=headers))


def _call(req: urllib.request.Request) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def _metrics(worker: ServerProcess) -> Metrics:
    with urllib.request.urlopen(f"{worker.url}/metrics", timeout=10) as resp:
        return Metrics(resp.read().decode())


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
