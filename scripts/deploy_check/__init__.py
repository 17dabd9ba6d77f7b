"""Offline checks of everything under deploy/ (the Dockerfile, systemd unit, Kubernetes manifests,
Grafana dashboard and Prometheus rules). `python -m scripts.deploy_check` runs them all;
`scripts/check_deploy.sh` adds the external tools (hadolint, systemd-analyze, kubectl kustomize).

Every check returns a list of problems (strings); empty means clean. Nothing here needs a
container engine, a cluster or network access.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
# Every kustomization that operators apply; each is rendered and validated.
KUSTOMIZATIONS = (
    K8S / "base",
    K8S / "overlays" / "dev-single-gpu",
    K8S / "overlays" / "h200-prod",
    K8S / "examples" / "pd-gateway",
    K8S / "examples" / "pd-gateway-grpc",
)
