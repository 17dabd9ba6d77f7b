"""The prefill peer's API: the same model name, context checks and info as the decode worker,
and /metrics (HTTP requests, request outcomes, prefill time), over HTTP with a scripted peer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from decode_worker.core.sampling import SamplingParams
from decode_worker.daemon.prefill.backend import PrefillBackend
from decode_worker.daemon.prefill.state import PrefillResult
from decode_worker.device.default_model import byte_tokenizer
from decode_worker.io.api import ApiApp, ApiConfig
from decode_worker.io.metrics import Metrics
from decode_worker.settings import TransferSettings
from tests.fakes.fake_backend import ServerThread


class ScriptedPeer:
    """Answers every room at once with token 65, or an error for room 13; room 99 never."""

    settings = TransferSettings()
    bootstrap_port = settings.bootstrap_port  # the bound port a real peer reports

    def add_prompt(self, room: int, token_ids: list[int],
                   on_done: Callable[[PrefillResult], None] | None = None,
                   sampling: SamplingParams | None = None) -> None:
        if on_done is None or room == 99:
            return
        error = "transfer broke" if room == 13 else None
        on_done(PrefillResult(room, None if error else 65, -0.1, 0, error))


@pytest.fixture
def peer_api(tmp_path: Path) -> Iterator[tuple[httpx.Client, Metrics]]:
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    metrics = Metrics()
    backend = PrefillBackend(ScriptedPeer(), tmp_path, 0.2, context_length=64, metrics=metrics)
    with ServerThread(ApiApp(backend, ApiConfig(), metrics)) as srv, \
            httpx.Client(base_url=srv.url, timeout=5) as client:
        yield client, metrics


def gen(room: int, n: int = 3, max_new: int | None = 2) -> dict[str, object]:
    sp = {} if max_new is None else {"max_new_tokens": max_new}
    return {"input_ids": [5] * n, "sampling_params": sp, "bootstrap_host": "127.0.0.1",
            "bootstrap_room": room}


def value(metrics: Metrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, labels)
    return got or 0.0


def test_info_names_the_model_path_and_no_radix_cache(
        peer_api: tuple[httpx.Client, Metrics], tmp_path: Path) -> None:
    client, _ = peer_api
    info = client.get("/server_info").json()
    assert info["served_model_name"] == str(tmp_path) and info["context_length"] == 64
    assert info["disaggregation_decode_enable_radix_cache"] is False
    assert info["enable_unified_radix_tree"] is False and info["disable_radix_cache"] is True
    assert client.get("/model_info").json()["served_model_name"] == str(tmp_path)
    assert client.get("/v1/models").json()["data"][0]["id"] == str(tmp_path)


def test_context_is_checked_as_on_the_decode_worker(
        peer_api: tuple[httpx.Client, Metrics]) -> None:
    client, _ = peer_api
    r = client.post("/generate", json=gen(1, n=40, max_new=25))
    assert r.status_code == 400 and "65 tokens" in r.json()["error"]["message"], r.text
    assert client.post("/generate", json=gen(1, n=40, max_new=None)).status_code == 200


def test_metrics_count_http_requests_outcomes_and_prefill_time(
        peer_api: tuple[httpx.Client, Metrics]) -> None:
    client, metrics = peer_api
    assert client.post("/generate", json=gen(1)).status_code == 200
    assert client.post("/generate", json=gen(13)).status_code == 502
    assert client.post("/generate", json=gen(99)).status_code == 504
    body = client.get("/metrics")
    assert body.status_code == 200 and "decode_worker_http_requests_total" in body.text
    http = "decode_worker_http_requests_total"
    assert [value(metrics, http, endpoint="generate", code=c) for c in ("200", "502", "504")] \
        == [1, 1, 1]
    statuses = [value(metrics, "decode_worker_requests_total", status=s)
                for s in ("finished", "failed", "aborted")]
    assert statuses == [1, 1, 1]
    assert value(metrics, "decode_worker_aborts_total", reason="kv_timeout") == 1
    assert value(metrics, "decode_worker_transfer_failures_total", reason="transfer_failed") == 1
    assert value(metrics, "decode_worker_time_to_first_token_seconds_count") == 1
    assert value(metrics, "decode_worker_request_e2e_seconds_count") == 1
