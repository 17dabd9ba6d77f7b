"""Deployment rules that schemas cannot express, checked on rendered Kubernetes objects.

For every workload that runs decode-worker (`serve` or `prefill`):
- its ConfigMaps hold only real settings, and they validate (through `load_settings`);
- readiness, liveness and startup probes GET /health on a port the container declares;
- a preStop hook, and terminationGracePeriodSeconds >= preStop sleep + drain announce (decode
  workers) + drain grace + margin (`drain.py`);
- liveness gives up only after longer than the drain (a draining pod answers 503);
- a GPU limit, an RDMA device request where RDMA is required, non-root, no privilege escalation;
- the container port equals DECODE_WORKER_SERVER__PORT; a PodDisruptionBudget covers it.
For every Service, PodDisruptionBudget and PodMonitor: the selector matches some pod, and the
named ports exist on those pods.
"""

from __future__ import annotations

from typing import Any

from decode_worker.errors import ConfigError
from decode_worker.settings import (
    ENV_PREFIX,
    UNIFIED_TREE_VARS,
    Settings,
    env_var_name,
    load_settings,
)
from scripts.deploy_check import drain

Obj = dict[str, Any]
WORKLOADS = ("Deployment", "StatefulSet")
PORT_KEY = "DECODE_WORKER_SERVER__PORT"
GPU = "nvidia.com/gpu"
RDMA_PREFIX = "rdma/"


def policy_problems(objs: list[Obj], require_rdma: bool = True) -> list[str]:
    """Every rule above, over one rendered kustomization."""
    problems: list[str] = []
    configmaps = {_name(o): o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
    pods = [o for o in objs if o["kind"] in WORKLOADS]
    for workload in pods:
        for container in _pod(workload).get("containers", []):
            if _runs_decode_worker(container):
                env = _env_of(container, configmaps, problems, _name(workload))
                problems += _container_problems(workload, container, env, require_rdma)
    problems += _selector_problems(objs, pods)
    return problems


def settings_problems(where: str, env: dict[str, str]) -> list[str]:
    """Load settings from `env` (our variables only); one problem per failure."""
    ours = {k: str(v) for k, v in env.items() if k.startswith(ENV_PREFIX) or k in UNIFIED_TREE_VARS}
    unknown = sorted(k for k in ours if k.startswith(ENV_PREFIX) and k not in known_env_vars())
    if unknown:
        return [f"{where}: not a setting: {', '.join(unknown)} (see docs/DEPLOY.md)"]
    try:
        load_settings(None, None, ours)
    except ConfigError as exc:
        return [f"{where}: {exc}"]
    return []


def known_env_vars() -> set[str]:
    """Every DECODE_WORKER_* variable the settings model reads."""
    return {
        env_var_name(f"{section}.{key}")
        for section, model in Settings.model_fields.items()
        for key in model.annotation.model_fields  # type: ignore[union-attr]
    }


def _env_of(container: Obj, configmaps: dict[str, Any], problems: list[str], who: str) -> dict:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef", {}).get("name")
        if ref is None:
            continue
        if ref not in configmaps:
            problems.append(f"{who}: envFrom ConfigMap {ref} is not in the manifests")
            continue
        problems += settings_problems(f"ConfigMap/{ref}", configmaps[ref])
        env.update(configmaps[ref])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def _container_problems(workload: Obj, c: Obj, env: dict, require_rdma: bool) -> list[str]:
    who = f"{_name(workload)}/{c['name']}"
    out = _probe_problems(who, c)
    announce, grace = drain.drain_s(env, _serves(c))
    budget = stop_budget_s(workload, c)
    if _pre_stop_s(c) is None:
        out.append(f"{who}: no preStop hook (sleep N) before the SIGTERM drain")
    out += drain.stop_problem(who, budget, announce, grace,
                              "terminationGracePeriodSeconds less preStop")
    live = c.get("livenessProbe", {})
    if live.get("periodSeconds", 10) * live.get("failureThreshold", 3) <= announce + grace:
        out.append(f"{who}: liveness gives up within the drain ({announce + grace:g} s)")
    out += _resource_problems(who, c, require_rdma)
    out += _security_problems(who, workload, c)
    declared = {p.get("containerPort") for p in c.get("ports", [])}
    if int(env.get(PORT_KEY, 30000)) not in declared:
        out.append(f"{who}: server port {env.get(PORT_KEY, 30000)} is not a containerPort")
    return out


def stop_budget_s(workload: Obj, c: Obj) -> float:
    """Seconds the container gets after SIGTERM: terminationGracePeriodSeconds (30 by
    default) less its preStop sleep."""
    period = float(_pod(workload).get("terminationGracePeriodSeconds", 30))
    return period - (_pre_stop_s(c) or 0.0)


def decode_stop_budgets(objs: list[Obj], where: str) -> dict[str, float]:
    """For every decode worker (`serve`) container of one rendered kustomization: a name ->
    the seconds it gets after SIGTERM (for `drain.config_problems`)."""
    return {f"{where}: {_name(w)} terminationGracePeriodSeconds less preStop":
            stop_budget_s(w, c)
            for w in objs if w["kind"] in WORKLOADS
            for c in _pod(w).get("containers", []) if _runs_decode_worker(c) and _serves(c)}


def _serves(c: Obj) -> bool:
    """Whether the container runs the decode worker (`serve`, the image's default command)."""
    args = [str(a) for a in c.get("command", []) + c.get("args", [])]
    return "prefill" not in args


def _probe_problems(who: str, c: Obj) -> list[str]:
    out = []
    names = {p.get("name") for p in c.get("ports", [])} | {p.get("containerPort")
                                                          for p in c.get("ports", [])}
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c.get(kind, {}).get("httpGet")
        if get is None or get.get("path") != "/health":
            out.append(f"{who}: {kind} must GET /health")
        elif get.get("port") not in names:
            out.append(f"{who}: {kind} port {get.get('port')} is not a container port")
    return out


def _pre_stop_s(c: Obj) -> float | None:
    pre_stop = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop.get("exec", {}).get("command", [])
    if len(command) == 2 and command[0] == "sleep":
        return float(command[1])
    return None


def _resource_problems(who: str, c: Obj, require_rdma: bool) -> list[str]:
    res = c.get("resources", {})
    out = []
    if GPU not in res.get("limits", {}):
        out.append(f"{who}: no {GPU} limit")
    has_rdma = any(k.startswith(RDMA_PREFIX) for k in res.get("limits", {}))
    if require_rdma and not has_rdma:
        out.append(f"{who}: no RDMA device resource ({RDMA_PREFIX}*) in limits")
    return out


def _security_problems(who: str, workload: Obj, c: Obj) -> list[str]:
    pod_sc = _pod(workload).get("securityContext", {})
    sc = c.get("securityContext", {})
    out = []
    if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))):
        out.append(f"{who}: runAsNonRoot is not set")
    if sc.get("allowPrivilegeEscalation") is not False:
        out.append(f"{who}: allowPrivilegeEscalation must be false")
    return out


def _selector_problems(objs: list[Obj], pods: list[Obj]) -> list[str]:
    out = []
    for obj in objs:
        kind = obj["kind"]
        selector = _selector_of(obj)
        if selector is None:
            continue
        matched = [w for w in pods if _matches(selector, _pod_labels(w))]
        if not matched:
            out.append(f"{kind}/{_name(obj)}: selector {selector} matches no pod")
        for port in _port_names(obj):
            if not any(port in _declared_port_names(w) for w in matched):
                out.append(f"{kind}/{_name(obj)}: port {port!r} is not declared by its pods")
    for workload in pods:
        if not any(o["kind"] == "PodDisruptionBudget"
                   and _matches(_selector_of(o) or {}, _pod_labels(workload)) for o in objs):
            out.append(f"{workload['kind']}/{_name(workload)}: no PodDisruptionBudget")
    return out


def _selector_of(obj: Obj) -> dict[str, str] | None:
    spec = obj.get("spec", {})
    if obj["kind"] == "Service":
        return dict(spec.get("selector", {}))
    if obj["kind"] in ("PodDisruptionBudget", "PodMonitor", "ServiceMonitor"):
        return dict(spec.get("selector", {}).get("matchLabels", {}))
    return None


def _port_names(obj: Obj) -> list[str]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Service":
        return [p["targetPort"] for p in spec.get("ports", [])
                if isinstance(p.get("targetPort"), str)]
    if obj["kind"] == "PodMonitor":
        return [e["port"] for e in spec.get("podMetricsEndpoints", []) if "port" in e]
    return []


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _pod(workload: Obj) -> Obj:
    return dict(workload.get("spec", {}).get("template", {}).get("spec", {}))


def _pod_labels(workload: Obj) -> dict[str, str]:
    return dict(workload["spec"]["template"].get("metadata", {}).get("labels", {}))


def _declared_port_names(workload: Obj) -> set[str]:
    return {p.get("name") for c in _pod(workload).get("containers", []) for p in c.get("ports", [])}


def _runs_decode_worker(c: Obj) -> bool:
    image = c.get("image", "").rsplit("/", 1)[-1].split(":")[0]
    return image == "decode-worker"


def _name(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("name"))
