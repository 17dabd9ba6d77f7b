"""`python -m scripts.deploy_check`: run every offline deploy check; exit 1 on any problem.
Besides deploy/, it holds every `configs/*.toml` to the supervisors' stop timeouts (`drain.py`).

Options:
  --kubectl            also render each kustomization with `kubectl kustomize` (when installed),
                       require the same objects as our renderer, and validate kubectl's output
  --k8s-root DIR       check the kustomizations under DIR instead of deploy/k8s (for tests)
  --metrics-file FILE  also require every queried series in this /metrics text (a live worker's)
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from scripts.deploy_check import (
    K8S,
    KUSTOMIZATIONS,
    drain,
    gateway,
    hostfiles,
    observability,
    policy,
    prometheusrule,
    schemas,
)
from scripts.deploy_check.kustomize import MERGE_KEYS, KustomizeError, render

NO_RDMA = {"dev-single-gpu"}  # kustomizations for nodes without an RDMA device plugin


def check_kustomization(directory: Path, use_kubectl: bool = False) -> list[str]:
    """Render one kustomization and check every object (schemas and policy)."""
    where = directory.name
    try:
        objs = render(directory)
    except (KustomizeError, OSError, yaml.YAMLError) as exc:
        return [f"{where}: cannot render: {exc}"]
    problems: list[str] = []
    if use_kubectl and shutil.which("kubectl"):
        theirs = _kubectl_render(directory)
        if isinstance(theirs, str):
            return [f"{where}: kubectl kustomize: {theirs}"]
        if _normalized(theirs) != _normalized(objs):
            problems.append(f"{where}: our renderer and kubectl kustomize disagree")
        objs = theirs
    for obj in objs:
        problems += [f"{where}: {p}" for p in schemas.schema_problems(obj)]
    problems += [f"{where}: {p}" for p in policy.policy_problems(objs, where not in NO_RDMA)]
    problems += [f"{where}: {p}" for p in gateway.gateway_problems(objs)]
    return problems


def orphan_problems(root: Path) -> list[str]:
    """Manifests under `root` that no kustomization lists (they would escape validation)."""
    listed: set[Path] = set()
    for kfile in root.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kfile.read_text()) or {}
        listed |= {(kfile.parent / r).resolve() for r in spec.get("resources", [])}
        listed |= {(kfile.parent / p["path"]).resolve() for p in spec.get("patches", [])}
    return [f"{path.relative_to(root)}: not listed in any kustomization.yaml"
            for path in sorted(root.rglob("*.yaml"))
            if path.name != "kustomization.yaml" and path.resolve() not in listed]


def run_all(k8s_root: Path = K8S, use_kubectl: bool = False,
            metrics: observability.Families | None = None) -> list[str]:
    """Every check; the list of problems (empty = all clean)."""
    problems = hostfiles.dockerfile_problems() + hostfiles.unit_problems()
    problems += hostfiles.lock_problems()
    problems += policy.settings_problems("decode-worker.env", hostfiles.env_file())
    budgets = {"systemd TimeoutStopSec": hostfiles.unit_stop_s() or 0.0,
               "docker stop -t": drain.DOCKER_STOP_S}
    for directory in (k8s_root / d.relative_to(K8S) for d in KUSTOMIZATIONS):
        problems += check_kustomization(directory, use_kubectl)
        with contextlib.suppress(KustomizeError, OSError, yaml.YAMLError):  # reported above
            budgets.update(policy.decode_stop_budgets(render(directory), directory.name))
    problems += drain.config_problems(budgets)
    problems += orphan_problems(k8s_root)
    problems += observability.dashboard_problems(extra=metrics)
    problems += observability.rules_problems(extra=metrics)
    problems += prometheusrule.stale_problems()
    return problems


def _kubectl_render(directory: Path) -> list[dict[str, Any]] | str:
    done = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120, check=False)
    if done.returncode != 0:
        return done.stderr.strip() or f"exit {done.returncode}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _normalized(objs: list[dict[str, Any]]) -> dict[tuple[str, ...], Any]:
    """Objects by identity, with merge-keyed lists sorted (kustomize may reorder them)."""
    def norm(value: Any, field: str = "") -> Any:
        if isinstance(value, dict):
            return {k: norm(v, k) for k, v in value.items()}
        if isinstance(value, list):
            items = [norm(v) for v in value]
            keys = MERGE_KEYS.get(field)
            if keys and all(isinstance(i, dict) for i in items):
                return sorted(items, key=lambda i: str([i.get(k) for k in keys]))
            return items
        return value

    return {(o["apiVersion"], o["kind"], o["metadata"].get("namespace", ""),
             o["metadata"]["name"]): norm(o) for o in objs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.deploy_check")
    parser.add_argument("--kubectl", action="store_true")
    parser.add_argument("--k8s-root", type=Path, default=K8S)
    parser.add_argument("--metrics-file", type=Path)
    args = parser.parse_args(argv)
    metrics = None
    if args.metrics_file is not None:
        metrics = observability.families_from_exposition(args.metrics_file.read_text())
    problems = run_all(args.k8s_root, args.kubectl, metrics)
    if schemas.missing_validator():
        print("note: kubernetes-validate not installed: built-in kinds not schema-checked")
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"deploy checks: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
