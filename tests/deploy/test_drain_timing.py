"""Drain timing agrees everywhere: every config under configs/, the systemd unit, the manifests and
the gateway's health checks against the drain announce window and grace (scripts/deploy_check/
drain.py); the smg flags DEPLOY.md and the gateway example give are the ones the rolling
restart test runs (`router.ROLLING_RESTART_FLAGS`)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from decode_worker.daemon.shared.router import ROLLING_RESTART_FLAGS
from scripts.deploy_check import KUSTOMIZATIONS, REPO, drain, hostfiles
from scripts.deploy_check.__main__ import check_kustomization
from scripts.deploy_check.kustomize import render
from tests.deploy.helpers import edit_yaml

EXAMPLE = next(d for d in KUSTOMIZATIONS if d.name == "pd-gateway")


def _pairs(flags: list[str] | tuple[str, ...]) -> dict[str, str]:
    return {flags[i]: flags[i + 1] for i in range(len(flags) - 1)
            if flags[i].startswith("--") and not flags[i + 1].startswith("--")}


def test_the_shipped_configs_fit_every_supervisor() -> None:
    budgets = {"systemd TimeoutStopSec": hostfiles.unit_stop_s() or 0.0,
               "docker stop -t": drain.DOCKER_STOP_S}
    assert drain.config_problems(budgets) == []


def test_a_config_whose_drain_outlasts_a_supervisor_is_reported(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    shutil.copytree(drain.CONFIGS, configs)
    h200 = configs / "gpt-oss-20b-h200.toml"
    h200.write_text(h200.read_text().replace("drain_grace_s = 30.0", "drain_grace_s = 60.0"))
    problems = drain.config_problems({"systemd TimeoutStopSec": 60.0}, configs)
    assert problems == ["configs/gpt-oss-20b-h200.toml: systemd TimeoutStopSec 60 s < drain "
                        "announce 6 + grace 60 + margin 10 = 76 s: the worker is killed "
                        "mid-drain"], problems


def test_the_unit_must_cover_the_announce_window_too(tmp_path: Path) -> None:
    env = tmp_path / "decode-worker.env"
    env.write_text(hostfiles.ENV_FILE.read_text().replace("DRAIN_ANNOUNCE_S=6",
                                                          "DRAIN_ANNOUNCE_S=25"))
    problems = hostfiles.unit_problems(env_path=env)
    assert any("TimeoutStopSec 60 s < drain announce 25" in p for p in problems), problems


def test_a_pod_killed_before_announce_and_grace_end_is_reported(k8s_copy: Path) -> None:
    def longer(doc: dict[str, Any]) -> None:
        doc["data"]["DECODE_WORKER_SERVER__DRAIN_ANNOUNCE_S"] = "20"

    edit_yaml(k8s_copy / "base" / "configmap.yaml", "ConfigMap", longer)
    problems = check_kustomization(k8s_copy / "base")
    assert any("terminationGracePeriodSeconds less preStop 55 s < drain announce 20" in p
               for p in problems), problems


def test_gateway_health_checks_slower_than_the_announce_window_are_reported(
        k8s_copy: Path) -> None:
    def slow(doc: dict[str, Any]) -> None:
        args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
        args[args.index("--health-check-interval-secs") + 1] = "5"

    edit_yaml(k8s_copy / "examples" / "pd-gateway" / "gateway.yaml", "Deployment", slow)
    problems = check_kustomization(k8s_copy / "examples" / "pd-gateway")
    assert any("health checks every 5 s x 2 failures = 10 s do not fit" in p
               for p in problems), problems


def test_the_gateway_example_and_deploy_md_give_the_tested_smg_flags() -> None:
    tested = _pairs(ROLLING_RESTART_FLAGS)
    gw = next(o for o in render(EXAMPLE) if o["kind"] == "Deployment")
    example = _pairs([str(a) for a in gw["spec"]["template"]["spec"]["containers"][0]["args"]])
    assert {k: example.get(k) for k in tested} == tested
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    command = re.search(r"```bash\npython -m smg\.launch_router --pd-disaggregation.*?```", text,
                        re.S)
    assert command is not None
    documented = _pairs(command.group(0).replace("\\\n", " ").split())
    assert {k: documented.get(k) for k in tested} == tested
