"""Validate rendered objects against Kubernetes' OpenAPI schemas, offline.

Built-in kinds: the `kubernetes-validate` package (it carries the schemas of every Kubernetes
release), strict mode so misspelt fields fail. Prometheus Operator kinds: the minimal schemas
vendored in deploy/k8s/schemas/. Without `kubernetes-validate` installed, built-in kinds are
reported as skipped rather than passing silently (`missing_validator`).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema

from scripts.deploy_check import K8S

# The oldest release we support and the newest the validator knows.
K8S_VERSIONS = ("1.30.0", "latest")
VENDORED = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
}


def missing_validator() -> bool:
    """True when `kubernetes-validate` is not installed (built-in kinds cannot be checked)."""
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return True
    return False


def schema_problems(obj: dict[str, Any]) -> list[str]:
    """Problems of one object against its schema; [] when it validates."""
    what = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    vendored = VENDORED.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if vendored is not None:
        return _vendored(what, vendored, obj)
    if missing_validator():
        return []
    return _builtin(what, obj)


def _vendored(what: str, name: str, obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(_schema(name))
    return [f"{what}: {'/'.join(map(str, e.path))}: {e.message}"
            for e in validator.iter_errors(obj)]


@cache
def _schema(name: str) -> dict[str, Any]:
    return dict(json.loads((K8S / "schemas" / name).read_text()))


def _builtin(what: str, obj: dict[str, Any]) -> list[str]:
    import kubernetes_validate as kv

    problems = []
    for version in K8S_VERSIONS:
        wanted = kv.latest_version() if version == "latest" else version
        try:
            kv.validate(obj, wanted, strict=True)
        except kv.SchemaNotFoundError:
            problems.append(f"{what}: no schema for {obj.get('apiVersion')} {obj.get('kind')}"
                            f" in Kubernetes {wanted} (vendor one in deploy/k8s/schemas/)")
        except kv.ValidationError as exc:
            path = "/".join(map(str, exc.path))
            problems.append(f"{what}: Kubernetes {wanted}: {path}: {exc.message}")
    return problems
