"""Checks of a rendered kustomization's PD router (the SGLang Model Gateway): the worker URLs it
is given must be exactly the StatefulSet replicas that exist, and its flags must parse.

A router routes only to the `--prefill` / `--decode` URLs on its command line, so raising a
StatefulSet's replicas without adding URLs leaves the new pods idle, and lowering them leaves
URLs that never answer. Each URL must name `http://<statefulset>-<i>.<serviceName>:<port>` for
every `i` below the replicas, once. When smg is installed, the container's arguments also go
through smg's own parser (`smg.launch_router.parse_router_args`): an unknown flag or a bad
value is a problem here, not a crash loop in the cluster. Its health checks (interval x failure
threshold) must fit in the decode workers' drain announce window (`drain.py`).
"""

from __future__ import annotations

import contextlib
import io
import re
from typing import Any

from scripts.deploy_check import drain

Obj = dict[str, Any]
SMG_INTERVAL_S, SMG_FAILURES = 60, 3  # smg 1.13's defaults (python -m smg.launch_router --help)
_URL = re.compile(r"^(?:http|grpc)://(?P<pod>[a-z0-9-]+)-(?P<i>\d+)\.(?P<svc>[a-z0-9-]+):\d+$")


def gateway_problems(objs: list[Obj]) -> list[str]:
    """Problems of every Deployment whose container runs a router in PD mode."""
    sets = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "StatefulSet"}
    out: list[str] = []
    for obj in objs:
        if obj.get("kind") != "Deployment":
            continue
        for container in obj["spec"]["template"]["spec"].get("containers", []):
            args = [str(a) for a in container.get("args", [])]
            if "--pd-disaggregation" in args:
                where = f"Deployment {obj['metadata']['name']}"
                out += _url_problems(where, "--prefill", _urls(args, "--prefill"), sets)
                out += _url_problems(where, "--decode", _urls(args, "--decode"), sets)
                out += [f"{where}: {p}" for p in smg_parse_problems(args)]
                out += drain.router_problems(
                    where, float(_flag(args, "--health-check-interval-secs", SMG_INTERVAL_S)),
                    int(_flag(args, "--health-failure-threshold", SMG_FAILURES)),
                    _announce_s(objs))
    return out


def _flag(args: list[str], flag: str, default: float) -> str:
    """The value of the last `flag` in `args` (as smg's parser takes it), else `default`."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values[-1] if values else str(default)


def _announce_s(objs: list[Obj]) -> float:
    """The decode workers' announce window: from a ConfigMap that sets it, else the default."""
    env: dict[str, str] = {}
    for obj in objs:
        if obj.get("kind") == "ConfigMap" and drain.ANNOUNCE_KEY in obj.get("data", {}):
            env[drain.ANNOUNCE_KEY] = obj["data"][drain.ANNOUNCE_KEY]
    return drain.drain_s(env)[0]


def _urls(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def _url_problems(where: str, flag: str, urls: list[str], sets: dict[str, Obj]) -> list[str]:
    if not urls:
        return [f"{where}: no {flag} URL"]
    out, seen = [], []
    for url in urls:
        m = _URL.match(url)
        sts = sets.get(m["pod"]) if m else None
        if m is None or sts is None or sts["spec"].get("serviceName") != m["svc"]:
            out.append(f"{where}: {flag} {url} names no StatefulSet pod of this kustomization")
            continue
        seen.append((m["pod"], int(m["i"])))
    for name in sorted({pod for pod, _ in seen}):
        replicas = int(sets[name]["spec"].get("replicas", 1))
        have = sorted(i for pod, i in seen if pod == name)
        if have != list(range(replicas)):
            out.append(f"{where}: {flag} URLs list {name} pods {have}, but it has {replicas} "
                       f"replicas (list each of 0..{replicas - 1} once)")
    return out


def smg_parse_problems(args: list[str]) -> list[str]:
    """What smg's own argument parser says about `args` (nothing when smg is not installed)."""
    try:
        from smg.launch_router import parse_router_args
    except ImportError:
        return []
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = parse_router_args(args)
            parsed._validate_router_args()
    except SystemExit:
        return [f"smg refuses the arguments: {err.getvalue().strip()[-300:]}"]
    except Exception as exc:  # smg's validation raises plain exceptions (ValueError, ...)
        return [f"smg refuses the arguments: {exc}"]
    return []
