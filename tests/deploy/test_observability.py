"""Dashboard and alert rules query only what the daemon exports, and are well formed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from decode_worker.io.metrics import Metrics
from scripts.deploy_check import observability as obs
from scripts.deploy_check import prometheusrule
from scripts.deploy_check.promql import analyse


def _dashboard_series() -> set[str]:
    dash = json.loads(obs.DASHBOARD.read_text())
    names: set[str] = set()
    for panel in obs._panels(dash["panels"]):
        for target in panel.get("targets", []):
            names |= set(analyse(target["expr"]).metrics)
    return names


def test_dashboard_and_rules_are_clean() -> None:
    assert obs.dashboard_problems() == []
    assert obs.rules_problems() == []


def test_every_dashboard_series_is_in_contracts_and_registry() -> None:
    contracts = obs.series_of(obs.families_from_contracts())
    registry = obs.families_from_registry()
    assert registry is not None
    exported = obs.series_of(registry)
    for name in _dashboard_series() - set(obs.EXTERNAL_SERIES):
        assert name in contracts and name in exported, name


def test_dashboard_checks_against_a_metrics_exposition() -> None:
    # The text a running worker serves on /metrics comes from this registry.
    metrics = Metrics()
    metrics.transfer_failures.labels(reason="peer_dead").inc()
    text = generate_latest(metrics.registry).decode()
    families = obs.families_from_exposition(text)
    assert families["decode_worker_aborts_total"][0] == "counter"
    assert obs.dashboard_problems(extra=families) == []
    assert obs.rules_problems(extra=families) == []


def test_contract_and_registry_agree() -> None:
    registry = obs.families_from_registry()
    assert registry is not None
    assert set(obs.series_of(obs.families_from_contracts())) == set(obs.series_of(registry))


def test_unknown_metric_in_dashboard_fails(tmp_path: Path) -> None:
    dash = json.loads(obs.DASHBOARD.read_text())
    dash["panels"][1]["targets"][0]["expr"] = "sum(decode_worker_kv_pages_free)"
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dash))
    assert any("decode_worker_kv_pages_free is not exported" in p
               for p in obs.dashboard_problems(path))


def test_unknown_label_and_missing_panel_fail(tmp_path: Path) -> None:
    dash = {"panels": [{"id": 1, "title": "x", "targets": [
        {"expr": 'sum(decode_worker_queue_requests{pool="full"})'}]}]}
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dash))
    problems = obs.dashboard_problems(path)
    assert any("no label(s) ['pool']" in p for p in problems), problems
    assert any("no panel for TTFT" in p for p in problems), problems


def test_dashboard_without_a_per_worker_hit_rate_fails(tmp_path: Path) -> None:
    dash = json.loads(obs.DASHBOARD.read_text())
    for panel in dash["panels"]:  # the same queries summed over every worker
        for target in panel.get("targets", []):
            target["expr"] = target["expr"].replace("sum by (instance)", "sum")
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dash))
    assert any("no panel for prefix hit rate per worker" in p
               for p in obs.dashboard_problems(path))


def test_dashboard_without_the_host_tier_panels_fails(tmp_path: Path) -> None:
    dash = json.loads(obs.DASHBOARD.read_text())
    dash["panels"] = [p for p in dash["panels"] if "Host tier" not in p["title"]
                      and p["title"] != "Restore duration"]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dash))
    problems = obs.dashboard_problems(path)
    for topic in ("host tier hits", "host tier restore bytes", "host tier restore duration",
                  "host tier written bytes"):
        assert any(f"no panel for {topic}" in p for p in problems), (topic, problems)


def _rules_with(tmp_path: Path, **change: str) -> Path:
    doc = yaml.safe_load(obs.RULES.read_text())
    doc["groups"][0]["rules"][2].update(change)
    path = tmp_path / "r.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(("change", "expected"), [
    ({"expr": "rate(decode_worker_kv_pages_used[5m]) > 0"}, "not a counter"),
    ({"expr": "sum(decode_worker_kv_pages_used{pool=\"full\"} > 0"}, "unclosed"),
    ({"expr": "histogram_quantile(0.9, sum(rate(decode_worker_ttft_bucket[5m])))"},
     "not exported"),
    ({"for": "5 minutes"}, "not a duration"),
    ({"alert": "kv_pool_low"}, "CamelCase"),
])
def test_broken_rule_fails(tmp_path: Path, change: dict[str, str], expected: str) -> None:
    problems = obs.rules_problems(_rules_with(tmp_path, **change))
    assert any(expected in p for p in problems), problems


def test_missing_required_alert_fails(tmp_path: Path) -> None:
    doc = yaml.safe_load(obs.RULES.read_text())
    doc["groups"][0]["rules"] = [r for r in doc["groups"][0]["rules"]
                                 if r["alert"] != "DecodeWorkerAdmissionStalled"]
    path = tmp_path / "r.yml"
    path.write_text(yaml.safe_dump(doc))
    assert any("missing alert DecodeWorkerAdmissionStalled" in p
               for p in obs.rules_problems(path))


@pytest.mark.parametrize(("expr", "problem"), [
    ("sum by (le) (rate(a_bucket[5m]))", None),
    ("histogram_quantile(0.5, sum(rate(a_bucket[5m])))", "drops `le`"),
    ("histogram_quantile(0.5, rate(a_total[5m]))", "no *_bucket"),
    ("rate(a_total)", "needs a range"),
    ("rate(a_total[5 m])", "bad range"),
    ("sum(a) by (x))", "unbalanced"),
    ("frobnicate(a)", "unknown function"),
    ('a{b="c"} offset 5m and on (job) c_total', None),
    ("avg_over_time(a[10m:1m]) * 1e3", None),
])
def test_promql_sanity(expr: str, problem: str | None) -> None:
    problems = analyse(expr).problems
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_prometheusrule_matches_the_rules_file() -> None:
    assert prometheusrule.stale_problems() == []
    assert prometheusrule.build()["spec"]["groups"] == yaml.safe_load(
        obs.RULES.read_text())["groups"]


def test_stale_prometheusrule_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text(prometheusrule.render().replace("for: 2m", "for: 3m"))
    monkeypatch.setattr(prometheusrule, "TARGET", stale)
    assert prometheusrule.stale_problems()
