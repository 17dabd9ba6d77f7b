"""deploy/k8s/base/prometheusrule.yaml: the alert rules wrapped for the Prometheus Operator.

    python -m scripts.deploy_check.prometheusrule           # regenerate from the rules file
    python -m scripts.deploy_check.prometheusrule --check   # exit 1 if it is stale

deploy/prometheus/decode-worker.rules.yml is the source; the PrometheusRule carries the same
`groups` so that Kubernetes users get the alerts with `kubectl apply -k`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from scripts.deploy_check import K8S
from scripts.deploy_check.observability import RULES

TARGET = K8S / "base" / "prometheusrule.yaml"
HEADER = ("# Generated from deploy/prometheus/decode-worker.rules.yml by\n"
          "# `python -m scripts.deploy_check.prometheusrule`; edit the rules file, not this.\n")


def build() -> dict[str, Any]:
    """The PrometheusRule object for the current rules file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "decode-worker",
                     "labels": {"app.kubernetes.io/name": "decode-worker",
                                "app.kubernetes.io/component": "decode"}},
        "spec": {"groups": groups},
    }


def render() -> str:
    return HEADER + yaml.safe_dump(build(), sort_keys=False, width=100)


def stale_problems() -> list[str]:
    """[] when the generated file matches the rules file."""
    if not TARGET.is_file() or yaml.safe_load(TARGET.read_text()) != build():
        return [f"{TARGET.name} is stale: run python -m scripts.deploy_check.prometheusrule"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.deploy_check.prometheusrule")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_problems()
        print("\n".join(problems) or "prometheusrule.yaml: in sync")
        return 1 if problems else 0
    TARGET.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
