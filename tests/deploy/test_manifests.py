"""Every manifest validates and follows the deployment rules; broken ones make the checker fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scripts.deploy_check import KUSTOMIZATIONS, REPO, schemas
from scripts.deploy_check.__main__ import check_kustomization, orphan_problems
from scripts.deploy_check.kustomize import render
from tests.deploy.helpers import edit_yaml

needs_validator = pytest.mark.skipif(schemas.missing_validator(),
                                     reason="kubernetes-validate not installed")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_kustomization_is_clean(directory: Path) -> None:
    assert check_kustomization(directory) == []


def test_no_manifest_escapes_validation() -> None:
    assert orphan_problems(KUSTOMIZATIONS[0].parent) == []


def test_prod_requests_gpu_and_rdma_dev_only_gpu() -> None:
    def limits(directory: Path) -> dict[str, Any]:
        sts = next(o for o in render(directory) if o["kind"] == "StatefulSet")
        return dict(sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"])

    assert {"nvidia.com/gpu", "rdma/rdma_shared_device_a"} <= set(limits(KUSTOMIZATIONS[2]))
    dev = limits(KUSTOMIZATIONS[1])
    assert "nvidia.com/gpu" in dev and not any(k.startswith("rdma/") for k in dev)


def _sts_pod(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["spec"]["template"]["spec"])


def _grace(doc: dict[str, Any]) -> None:
    doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 20


def _probe(doc: dict[str, Any]) -> None:
    _sts_pod(doc)["containers"][0]["readinessProbe"]["httpGet"]["path"] = "/healthz"


def _no_prestop(doc: dict[str, Any]) -> None:
    del _sts_pod(doc)["containers"][0]["lifecycle"]


def _root(doc: dict[str, Any]) -> None:
    _sts_pod(doc)["securityContext"]["runAsNonRoot"] = False


BROKEN = [
    ("statefulset.yaml", "StatefulSet", _grace, "terminationGracePeriodSeconds"),
    ("statefulset.yaml", "StatefulSet", _probe, "readinessProbe must GET /health"),
    ("statefulset.yaml", "StatefulSet", _no_prestop, "no preStop"),
    ("statefulset.yaml", "StatefulSet", _root, "runAsNonRoot"),
    ("configmap.yaml", "ConfigMap",
     lambda d: d["data"].update(DECODE_WORKER_SERVER__PROT="1"), "not a setting"),
    ("configmap.yaml", "ConfigMap",
     lambda d: d["data"].update(DECODE_WORKER_CACHE__PAGE_SIZE="0"), "PAGE_SIZE"),
    ("podmonitor.yaml", "PodMonitor",
     lambda d: d["spec"]["podMetricsEndpoints"][0].update(port="metrics"), "not declared"),
    ("podmonitor.yaml", "PodMonitor",
     lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"), "interval"),
    ("poddisruptionbudget.yaml", "PodDisruptionBudget",
     lambda d: d["spec"]["selector"]["matchLabels"].update(extra="x"), "matches no pod"),
]


@pytest.mark.parametrize(("file", "kind", "change", "expected"), BROKEN,
                         ids=[b[3] for b in BROKEN])
def test_checker_catches_broken_base(k8s_copy: Path, file: str, kind: str, change: Any,
                                     expected: str) -> None:
    edit_yaml(k8s_copy / "base" / file, kind, change)
    problems = check_kustomization(k8s_copy / "base")
    assert any(expected in p for p in problems), problems


@needs_validator
def test_schema_catches_misspelt_field(k8s_copy: Path) -> None:
    edit_yaml(k8s_copy / "base" / "service.yaml", "Service",
              lambda d: d["spec"].update(selectr={"a": "b"}))
    problems = check_kustomization(k8s_copy / "base")
    assert any("selectr" in p for p in problems), problems


@needs_validator
def test_schema_catches_wrong_type(k8s_copy: Path) -> None:
    edit_yaml(k8s_copy / "base" / "statefulset.yaml", "StatefulSet",
              lambda d: d["spec"].update(replicas="two"))
    problems = check_kustomization(k8s_copy / "base")
    assert any("replicas" in p and "integer" in p for p in problems), problems


def test_overlay_patch_to_missing_object_fails(k8s_copy: Path) -> None:
    patch = k8s_copy / "overlays" / "h200-prod" / "statefulset.yaml"
    patch.write_text(patch.read_text().replace("name: decode-worker\n", "name: decoder\n", 1))
    problems = check_kustomization(k8s_copy / "overlays" / "h200-prod")
    assert problems and "cannot render" in problems[0]


def test_orphan_manifest_is_reported(k8s_copy: Path) -> None:
    (k8s_copy / "base" / "extra.yaml").write_text("apiVersion: v1\nkind: Service\n")
    assert any("extra.yaml" in p for p in orphan_problems(k8s_copy))


def test_checker_cli_exits_nonzero_on_a_broken_manifest(k8s_copy: Path) -> None:
    edit_yaml(k8s_copy / "base" / "statefulset.yaml", "StatefulSet", _grace)
    done = subprocess.run([sys.executable, "-m", "scripts.deploy_check", "--k8s-root",
                           str(k8s_copy)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "terminationGracePeriodSeconds" in done.stdout


def test_checker_cli_passes_on_the_shipped_files() -> None:
    done = subprocess.run([sys.executable, "-m", "scripts.deploy_check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
