"""The PD gateway example: its worker URLs are exactly the replicas that exist, and smg's own
parser accepts its flags; a drifted copy makes the checker fail with a message."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts.deploy_check import KUSTOMIZATIONS
from scripts.deploy_check.__main__ import check_kustomization
from scripts.deploy_check.gateway import gateway_problems, smg_parse_problems
from scripts.deploy_check.kustomize import render
from tests.deploy.helpers import edit_yaml

EXAMPLE = next(d for d in KUSTOMIZATIONS if d.name == "pd-gateway")
GRPC_EXAMPLE = next(d for d in KUSTOMIZATIONS if d.name == "pd-gateway-grpc")
needs_smg = pytest.mark.skipif(importlib.util.find_spec("smg") is None,
                               reason="smg is not installed")


def _args(objs: list[dict[str, Any]]) -> list[str]:
    gw = next(o for o in objs if o["kind"] == "Deployment")
    return [str(a) for a in gw["spec"]["template"]["spec"]["containers"][0]["args"]]


def test_example_lists_every_prefill_and_decode_replica_once() -> None:
    objs = render(EXAMPLE)
    assert gateway_problems(objs) == []
    args = _args(objs)
    assert args.count("--decode") == 3 and args.count("--prefill") == 2
    assert args[args.index("--decode-policy") + 1] == "cache_aware"
    assert "--routing-key-override" in args


def test_more_replicas_than_urls_is_reported(k8s_copy: Path) -> None:
    kfile = k8s_copy / "examples" / "pd-gateway" / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text())
    spec["replicas"] = [{"name": "decode-worker", "count": 4}, *spec["replicas"][1:]]
    kfile.write_text(yaml.safe_dump(spec))
    problems = check_kustomization(kfile.parent)
    assert any("--decode URLs list decode-worker pods [0, 1, 2], but it has 4 replicas" in p
               for p in problems), problems


def test_a_url_naming_no_pod_is_reported(k8s_copy: Path) -> None:
    def change(dep: dict[str, Any]) -> None:
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--decode") + 1] = "http://decode-7.elsewhere:30000"

    edit_yaml(k8s_copy / "examples" / "pd-gateway" / "gateway.yaml", "Deployment", change)
    problems = gateway_problems(render(k8s_copy / "examples" / "pd-gateway"))
    assert any("http://decode-7.elsewhere:30000 names no StatefulSet pod" in p
               for p in problems), problems


@needs_smg
def test_smg_parses_the_example_and_refuses_a_bad_flag() -> None:
    args = _args(render(EXAMPLE))
    assert smg_parse_problems(args) == []
    bad = [*args, "--decode-policy", "fastest"]
    assert any("smg refuses" in p and "fastest" in p for p in smg_parse_problems(bad))


def test_grpc_example_points_smg_at_every_workers_grpc_port() -> None:
    objs = render(GRPC_EXAMPLE)
    assert gateway_problems(objs) == []
    args = _args(objs)
    urls = [args[i + 1] for i, a in enumerate(args) if a in ("--prefill", "--decode")]
    assert len(urls) == 5 and all(u.startswith("grpc://") and u.endswith(":30001")
                                  for u in urls)
    assert args[args.index("--policy") + 1] == "cache_aware"  # smg subscribes to KV events
    maps = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    assert maps["decode-worker-config"]["DECODE_WORKER_SERVER__GRPC_PORT"] == "30001"
    assert maps["prefill-worker-config"]["DECODE_WORKER_SERVER__GRPC_PORT"] == "30001"


@needs_smg
def test_smg_parses_the_grpc_example() -> None:
    assert smg_parse_problems(_args(render(GRPC_EXAMPLE))) == []
