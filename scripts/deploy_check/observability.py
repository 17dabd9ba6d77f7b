"""Checks of the Grafana dashboard and the Prometheus alert rules against the daemon's metrics.

The metrics the daemon exports come from three places, checked in this order of authority:
a running worker's `/metrics` text (`families_from_exposition`, for a live check), the registry of
`decode_worker.io.metrics.Metrics` (`families_from_registry`), and the table in docs/CONTRACTS.md
(`families_from_contracts`). A query may read only series that exist in every source given.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from scripts.deploy_check import DEPLOY, REPO
from scripts.deploy_check.promql import TARGET_LABELS, analyse

DASHBOARD = DEPLOY / "grafana" / "decode-worker.json"
RULES = DEPLOY / "prometheus" / "decode-worker.rules.yml"
# Series from Prometheus itself, not from the daemon.
EXTERNAL_SERIES = {"up": set[str]()}
REQUIRED_ALERTS = {
    "DecodeWorkerDown", "DecodeWorkerKVPoolExhausted", "DecodeWorkerHighAbortRate",
    "DecodeWorkerTransferFailures", "DecodeWorkerAdmissionStalled",
}
# What the dashboard must show: topic -> a series one of its queries must read.
REQUIRED_PANELS = {
    "pool use per pool": "decode_worker_kv_pages_used",
    "prefix hit rate": "decode_worker_prefix_cache_hit_tokens_total",
    "queue depths": "decode_worker_queue_requests",
    "transfer throughput": "decode_worker_transfer_bytes_total",
    "transfer latency": "decode_worker_transfer_duration_seconds_bucket",
    "aborts by reason": "decode_worker_aborts_total",
    "TTFT": "decode_worker_time_to_first_token_seconds_bucket",
    "ITL": "decode_worker_inter_token_latency_seconds_bucket",
    "host tier pages": "decode_worker_kv_pages_capacity",
    "host tier hits": "decode_worker_prefix_cache_host_hit_tokens_total",
    "host tier restore bytes": "decode_worker_kv_host_restored_bytes_total",
    "host tier restore duration": "decode_worker_kv_host_restore_duration_seconds_bucket",
    "host tier written bytes": "decode_worker_kv_host_written_bytes_total",
}
# ... and per worker (`by (instance)`): topic -> the series such a query must read
PER_WORKER_PANELS = {
    "prefix hit rate per worker": "decode_worker_prefix_cache_hit_tokens_total",
}
SEVERITIES = {"critical", "warning", "info"}
_BY_INSTANCE = re.compile(r"\bby\s*\(\s*instance\s*\)")
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
_ROW = re.compile(r"^\|\s*`(decode_worker_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|")

Families = dict[str, tuple[str, set[str]]]  # family name -> (type, label names)


def families_from_contracts(path: Path = REPO / "docs" / "CONTRACTS.md") -> Families:
    """The metrics table of docs/CONTRACTS.md (counter names there already end in _total)."""
    out: Families = {}
    for line in path.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            labels = set(re.findall(r"`(\w+)`", m.group(3)))
            out[m.group(1)] = (m.group(2), labels)
    return out


def families_from_registry() -> Families | None:
    """Families of a fresh `Metrics()` registry; None when io/metrics.py is not importable."""
    try:
        from decode_worker.io.metrics import Metrics
    except ImportError:
        return None
    return {f.name: (f.type, set()) for f in Metrics().registry.collect()}


def families_from_exposition(text: str) -> Families:
    """Families named by the `# TYPE` lines of a Prometheus text exposition (a /metrics body)."""
    out: Families = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            out[parts[2]] = (parts[3], set())
    return out


def series_of(families: Families) -> dict[str, set[str]]:
    """Series names a query can read -> label names (empty set = labels unknown)."""
    out: dict[str, set[str]] = {}
    for name, (kind, labels) in families.items():
        if kind == "counter":
            out[name if name.endswith("_total") else name + "_total"] = labels
        elif kind in ("histogram", "summary"):
            base = name.removesuffix("_bucket")
            out[base + "_bucket"] = labels | {"le"}
            out[base + "_sum"] = labels
            out[base + "_count"] = labels
        else:
            out[name] = labels
    return out


def exported_series(extra: Families | None = None) -> list[dict[str, set[str]]]:
    """Every source of truth available here, each as `series_of`."""
    sources = [families_from_contracts(), families_from_registry(), extra]
    return [series_of(f) for f in sources if f is not None]


def expr_problems(where: str, expr: str, sources: list[dict[str, set[str]]]) -> list[str]:
    """PromQL sanity plus: every series read exists in every source, with the labels used."""
    analysis = analyse(expr)
    out = [f"{where}: {p}" for p in analysis.problems]
    for name, used in sorted(analysis.metrics.items()):
        if name in EXTERNAL_SERIES:
            continue
        for series in sources:
            if name not in series:
                out.append(f"{where}: {name} is not exported by the daemon")
                break
            known = series[name]
            extra = used - known - TARGET_LABELS
            if known and extra:
                out.append(f"{where}: {name} has no label(s) {sorted(extra)}")
    return out


def dashboard_problems(path: Path = DASHBOARD, extra: Families | None = None) -> list[str]:
    """Problems of the Grafana dashboard JSON (see REQUIRED_PANELS)."""
    try:
        dash = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [f"{path}: {exc}"]
    sources = exported_series(extra)
    out, read, per_worker, ids = [], set(), set(), []
    for panel in _panels(dash.get("panels", [])):
        ids.append(panel.get("id"))
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            out += expr_problems(f"panel {panel.get('title')!r}", expr, sources)
            read |= set(analyse(expr).metrics)
            if _BY_INSTANCE.search(expr):
                per_worker |= set(analyse(expr).metrics)
    if len(ids) != len(set(ids)):
        out.append(f"{path.name}: duplicate panel ids")
    for topic, series in REQUIRED_PANELS.items():
        if series not in read:
            out.append(f"{path.name}: no panel for {topic} (reads no {series})")
    for topic, series in PER_WORKER_PANELS.items():
        if series not in per_worker:
            out.append(f"{path.name}: no panel for {topic} (no query reads {series} "
                       "by (instance))")
    return out


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    flat = []
    for panel in panels:
        flat.append(panel)
        flat.extend(_panels(panel.get("panels", [])))
    return flat


def rules_problems(path: Path = RULES, extra: Families | None = None) -> list[str]:
    """promtool-style check of an alert rules file: structure, durations, labels, PromQL."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [f"{path}: {exc}"]
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        return [f"{path.name}: expected a mapping with a `groups` list"]
    sources = exported_series(extra)
    out: list[str] = []
    alerts: list[str] = []
    for group in doc["groups"]:
        if not isinstance(group, dict) or not group.get("name") or "rules" not in group:
            out.append(f"{path.name}: every group needs `name` and `rules`")
            continue
        for rule in group["rules"]:
            out += _rule_problems(rule, sources)
            alerts.append(str(rule.get("alert")))
    if len(alerts) != len(set(alerts)):
        out.append(f"{path.name}: duplicate alert names")
    out += [f"{path.name}: missing alert {a}" for a in sorted(REQUIRED_ALERTS - set(alerts))]
    return out


def _rule_problems(rule: Any, sources: list[dict[str, set[str]]]) -> list[str]:
    if not isinstance(rule, dict) or not isinstance(rule.get("alert"), str):
        return [f"rule {rule!r}: needs an `alert` name"]
    name = rule["alert"]
    allowed = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
    out = [f"{name}: unknown field {k!r}" for k in sorted(set(rule) - allowed)]
    if not re.match(r"^[A-Z][A-Za-z0-9]+$", name):
        out.append(f"{name}: alert names are CamelCase")
    if not isinstance(rule.get("expr"), str):
        return [*out, f"{name}: `expr` must be a string"]
    out += expr_problems(name, rule["expr"], sources)
    for key in ("for", "keep_firing_for"):
        if key in rule and not _DURATION.match(str(rule[key])):
            out.append(f"{name}: `{key}: {rule[key]}` is not a duration")
    if rule.get("labels", {}).get("severity") not in SEVERITIES:
        out.append(f"{name}: labels.severity must be one of {sorted(SEVERITIES)}")
    notes = rule.get("annotations", {})
    out += [f"{name}: no annotations.{k}" for k in ("summary", "description") if not notes.get(k)]
    return out
