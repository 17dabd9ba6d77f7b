"""Drain timing: the supervisors' stop timeouts, the drain settings and the router's health checks
agree.

On SIGTERM a decode worker (`serve`) first announces for `server.drain_announce_s` (/health 503
while it still serves), then gives running requests `server.drain_grace_s`, then stops (HTTP
close, compute thread: seconds). A prefill peer has no announce window. So every supervisor must
wait at least `announce + grace + MARGIN_S` after its SIGTERM (after a Kubernetes preStop sleep
too), and a router must have taken the worker out before the announce window ends: its
health-check interval x failure threshold must be shorter than the window.

`config_problems` holds every `configs/*.toml` to the shipped supervisors' budgets (the systemd
unit's TimeoutStopSec, each decode StatefulSet's terminationGracePeriodSeconds less its preStop,
`docker stop -t DOCKER_STOP_S` as docs/DEPLOY.md says).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from decode_worker.errors import ConfigError
from decode_worker.settings import ServerSettings, env_var_name, load_settings
from scripts.deploy_check import REPO

MARGIN_S = 10.0
DOCKER_STOP_S = 60.0  # docs/DEPLOY.md: `docker stop -t 60`
CONFIGS = REPO / "configs"
GRACE_KEY = env_var_name("server.drain_grace_s")
ANNOUNCE_KEY = env_var_name("server.drain_announce_s")
_DEFAULTS = ServerSettings.model_fields


def drain_s(env: Mapping[str, str], serve: bool = True) -> tuple[float, float]:
    """(announce, grace) seconds of a worker whose environment is `env` (a setting not there is
    its default); `serve` False (a prefill peer): no announce window."""
    grace = float(env.get(GRACE_KEY, _DEFAULTS["drain_grace_s"].default))
    announce = float(env.get(ANNOUNCE_KEY, _DEFAULTS["drain_announce_s"].default))
    return (announce if serve else 0.0), grace


def stop_problem(who: str, budget_s: float, announce_s: float, grace_s: float,
                 what: str) -> list[str]:
    """One problem when `budget_s` (what the supervisor waits after SIGTERM) is below
    announce + grace + MARGIN_S."""
    need = announce_s + grace_s + MARGIN_S
    if budget_s >= need:
        return []
    return [f"{who}: {what} {budget_s:g} s < drain announce {announce_s:g} + grace "
            f"{grace_s:g} + margin {MARGIN_S:g} = {need:g} s: the worker is killed mid-drain"]


def config_problems(budgets: Mapping[str, float], configs: Path = CONFIGS) -> list[str]:
    """Every `configs/*.toml` against every supervisor budget (name -> seconds it waits after
    SIGTERM); also a config that does not load."""
    out: list[str] = []
    for path in sorted(configs.glob("*.toml")):
        try:
            server = load_settings(path, None, {}).settings.server
        except ConfigError as exc:
            out.append(f"configs/{path.name}: {exc}")
            continue
        for name, budget in budgets.items():
            out += stop_problem(f"configs/{path.name}", budget, server.drain_announce_s,
                                server.drain_grace_s, name)
    return out


def router_problems(who: str, interval_s: float, failures: int, announce_s: float) -> list[str]:
    """The router must see the announce: `interval_s` x `failures` below the window."""
    if interval_s * failures < announce_s:
        return []
    return [f"{who}: health checks every {interval_s:g} s x {failures} failures = "
            f"{interval_s * failures:g} s do not fit in the decode workers' announce window "
            f"({announce_s:g} s, server.drain_announce_s): the router keeps sending to a worker "
            f"that refuses (lower --health-check-interval-secs / --health-failure-threshold, or "
            f"raise the window)"]
