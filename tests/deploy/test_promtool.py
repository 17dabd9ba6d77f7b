"""`promtool` (Prometheus' own linter) passes on what we ship and what we serve (issue 16):
`promtool check rules` on deploy/prometheus/*.yml, and `promtool check metrics` on the
`/metrics` text of a running decode worker and a running prefill peer after a P/D request.

CI installs promtool (`.ci/run`, Debian's `prometheus` package); without it these tests skip.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_worker.io.metrics import Metrics as WorkerMetrics
from scripts.deploy_check.observability import RULES
from tests.e2e.live_fixtures import Metrics

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed "
                                "(apt-get install prometheus; .ci/run does)")
PROMPT = [3 + (i * 7) % 250 for i in range(90)]


def check_metrics(text: str) -> subprocess.CompletedProcess[str]:
    """`promtool check metrics` on an exposition; exit 0 and no output when clean."""
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)


def assert_clean(text: str) -> None:
    res = check_metrics(text)
    assert res.returncode == 0 and not (res.stdout + res.stderr).strip(), res.stdout + res.stderr


def test_shipped_rules_pass_promtool_check_rules() -> None:
    rule_files = sorted(str(p) for p in RULES.parent.glob("*.yml"))
    assert str(RULES) in rule_files
    assert PROMTOOL is not None
    res = subprocess.run([PROMTOOL, "check", "rules", *rule_files], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_promtool_rejects_a_gauge_named_total() -> None:
    # the check these tests rely on does fail on the name issue 16 reported
    bad = ("# HELP decode_worker_kv_pages_total KV pages\n# TYPE decode_worker_kv_pages_total "
           'gauge\ndecode_worker_kv_pages_total{pool="full"} 1.0\n')
    res = check_metrics(bad)
    assert res.returncode != 0
    assert 'non-counter metrics should not have "_total" suffix' in res.stdout + res.stderr


def test_registry_exposition_is_promtool_clean() -> None:
    metrics = WorkerMetrics()
    metrics.observe_transfer(4096, 0.01, 4, 32)
    metrics.observe_push(4096)
    metrics.inc_http("generate", 200)
    assert_clean(metrics.exposition()[0].decode())


@pytest.fixture(scope="module")
def pd_scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Metrics, Metrics]]:
    """(decode worker, prefill peer) /metrics after two P/D requests through both servers."""
    from decode_worker.device.default_model import write_model
    from tests.e2e.driver import Workers

    model = write_model(tmp_path_factory.mktemp("promtool") / "tiny-gpt-oss", seed=0)
    with Workers(model, router=False, extra=[]) as w, ThreadPoolExecutor(2) as pool:
        for _ in range(2):
            out = w.generate(pool, PROMPT, 4)
            assert len(out["output_ids"]) == 4, out
        yield _scrape(w.decode.url), _scrape(w.prefill.url)


def _scrape(url: str) -> Metrics:
    import httpx

    resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200
    return Metrics(resp.text)


@pytest.mark.slow
def test_live_decode_worker_metrics_pass_promtool(pd_scrapes: tuple[Metrics, Metrics]) -> None:
    decode, _ = pd_scrapes
    assert decode.value("decode_worker_transfer_bytes_total") > 0
    assert decode.value("decode_worker_kv_pages_capacity", pool="full") > 0
    assert "decode_worker_kv_pages_total" not in decode.text
    assert_clean(decode.text)


@pytest.mark.slow
def test_live_prefill_peer_metrics_pass_promtool(pd_scrapes: tuple[Metrics, Metrics]) -> None:
    decode, prefill = pd_scrapes
    # its requests, its transfers and its prefill time
    assert prefill.value("decode_worker_requests_total", status="finished") == 2
    assert prefill.value("decode_worker_transfer_pushes_total") == 2
    pushed = prefill.value("decode_worker_transfer_pushed_bytes_total")
    assert pushed == decode.value("decode_worker_transfer_bytes_total") > 0
    assert prefill.value("decode_worker_time_to_first_token_seconds_count") == 2
    assert_clean(prefill.text)
