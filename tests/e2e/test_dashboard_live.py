"""Every series the Grafana dashboard and the Prometheus alert rules query is exported by a
RUNNING decode worker (issue 8): scrape `/metrics` after a small workload and check names,
label names and the literal label values the queries match on (issue 7's metric list)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from scripts.deploy_check import observability as obs
from scripts.deploy_check.promql import TARGET_LABELS, analyse
from tests.e2e.live_fixtures import Live, Metrics, gen_body, raw_stream

pytestmark = pytest.mark.slow
LONG = [3 + (i * 13) % 250 for i in range(300)]  # past window + page: a repeat hits the cache
_SELECTOR = re.compile(r"(decode_worker_\w+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_WORDS = re.compile(r"^\w+(\|\w+)*$")


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard target, template variable query and alert rule."""
    dash = json.loads(obs.DASHBOARD.read_text())
    out = [(f"panel {p.get('title')!r}", t["expr"])
           for p in obs._panels(dash["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        m = re.match(r"label_values\((.*),\s*\w+\)$", str(var.get("definition", "")))
        if m:
            out.append((f"variable ${var['name']}", m.group(1)))
    rules = yaml.safe_load(obs.RULES.read_text())
    out += [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    return out


QUERIES = _queries()
QUERIED = sorted({name for _, expr in QUERIES for name in analyse(expr).metrics}
                 - set(obs.EXTERNAL_SERIES))
# Exported, but with no sample until the first failure: rate()/increase() cannot see the first
# increment of a series that appears at 1, so the alert misses a lone failure.


@pytest.fixture(scope="module")
def scrapes(plain_live: Live) -> tuple[Metrics, Metrics]:
    """The shared worker's /metrics once idle before and after a workload touching every
    endpoint, the prefix cache, a client abort and a bad request."""
    before = plain_live.wait_idle()
    _workload(plain_live)
    return before, plain_live.wait_idle()


@pytest.fixture(scope="module")
def scraped(scrapes: tuple[Metrics, Metrics]) -> Metrics:
    """/metrics after the workload."""
    return scrapes[1]


def _workload(live: Live) -> None:
    for _ in range(2):
        assert live.post("/generate", gen_body(LONG, 4)).status_code == 200
    assert live.sse("/generate", gen_body(LONG[:50], 6, stream=True))[-1] == "[DONE]"
    comp = {"prompt": LONG[:30], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert live.post("/v1/completions", comp).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    assert live.post("/v1/chat/completions", chat).status_code == 200
    assert live.post("/generate", raw=b"{nope").status_code == 400
    raw_stream(live.port, "/generate", gen_body(LONG[:40], 4000, stream=True), events=3).close()


@pytest.mark.parametrize("name", QUERIED)
def test_queried_series_has_samples_on_a_running_worker(scraped: Metrics, name: str) -> None:
    assert name in scraped.names(), f"{name} has no sample in a running worker's /metrics"


def test_queried_series_are_declared_by_the_running_worker(scraped: Metrics) -> None:
    declared = obs.series_of(obs.families_from_exposition(scraped.text))
    missing = [(where, name) for where, expr in QUERIES for name in analyse(expr).metrics
               if name not in obs.EXTERNAL_SERIES and name not in declared]
    assert missing == []


def test_queried_label_names_exist_on_the_series(scraped: Metrics) -> None:
    labels: dict[str, set[str]] = {}
    for s in scraped.samples:
        labels.setdefault(s.name, set()).update(s.labels)
    problems = []
    for where, expr in QUERIES:
        for name, used in analyse(expr).metrics.items():
            if name in labels:
                extra = used - labels[name] - TARGET_LABELS
                if extra:
                    problems.append(f"{where}: {name} has no label(s) {sorted(extra)}")
    assert problems == []


def test_matched_label_values_are_exported(scraped: Metrics) -> None:
    """`pool="swa"`, `queue="prealloc"`, `reason!~"client_abort|drain"`: every literal value a
    query matches on is a value the worker exports (a typo would silently match nothing)."""
    values: dict[tuple[str, str], set[str]] = {}
    for s in scraped.samples:
        for k, v in s.labels.items():
            values.setdefault((s.name, k), set()).add(v)
    problems = []
    for where, expr in QUERIES:
        for name, body in _SELECTOR.findall(expr):
            for label, _op, value in _MATCHER.findall(body):
                if label in TARGET_LABELS or "$" in value or not _WORDS.match(value):
                    continue
                known = values.get((name, label), set())
                problems += [f"{where}: {name}{{{label}={v!r}}} is never exported"
                             for v in value.split("|") if v not in known]
    assert problems == []


def test_the_workload_shows_on_the_dashboard_series(scrapes: tuple[Metrics, Metrics]) -> None:
    before, scraped = scrapes

    def v(name: str, **labels: str) -> float:
        """What the workload added to a counter (the worker is shared: earlier tests count
        on it too)."""
        return scraped.value(name, **labels) - before.value(name, **labels)

    assert v("decode_worker_prefix_cache_hit_tokens_total") > 0
    assert v("decode_worker_prefix_cache_query_tokens_total") >= v(
        "decode_worker_prefix_cache_hit_tokens_total")
    assert v("decode_worker_aborts_total", reason="client_abort") == 1
    assert v("decode_worker_requests_total", status="finished") == 5
    assert v("decode_worker_admissions_total") >= 6
    # every token sent to a client counts, the first one (from prefill) included
    assert v("decode_worker_generated_tokens_total") >= 4 * 2 + 6 + 3 + 3
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_e2e_seconds"):
        assert v(f"decode_worker_{hist}_count") > 0, hist
    assert v("decode_worker_http_requests_total", endpoint="generate", code="400") == 1
    assert scraped.value("decode_worker_draining") == 0
    host = scraped.pool("host")  # the host tier is on by default with the radix cache
    # write_through copies on insert: the cached prompts have host copies (still on the device
    # too, so not host-evictable: only host-only leaves are)
    assert host["total"] > 0 and host["used"] > 0 and host["used"] + host["available"] == (
        host["total"])
    assert v("decode_worker_kv_host_written_bytes_total") > 0
    for pool in ("full", "swa"):
        p = scraped.pool(pool)
        assert p["total"] == {"full": 512, "swa": 128}[pool]
        assert p["available"] + p["evictable"] == p["total"] and p["protected"] == 0
