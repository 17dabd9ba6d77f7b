"""Parse checks of the Dockerfile, the systemd unit and the lock file (no external tools).

`scripts/check_deploy.sh` also runs hadolint and `systemd-analyze verify` where they exist; these
checks are the project's own rules on top, and what runs where neither tool is available.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts.deploy_check import DEPLOY, REPO, drain

DOCKERFILE = REPO / "Dockerfile"
UNIT = DEPLOY / "systemd" / "decode-worker@.service"
ENV_FILE = DEPLOY / "systemd" / "decode-worker.env"
LOCK = DEPLOY / "requirements.lock"
HTTP_PORT = 30000
BOOTSTRAP_PORT = 8998


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_problems(path: Path = DOCKERFILE) -> list[str]:
    """The image rules of issue 8: CUDA base by build arg, pinned lock, non-root, serve, health."""
    ins = dockerfile_instructions(path.read_text())
    final = _final_stage(ins)
    out = []
    if not any(k == "ARG" and a.startswith("CUDA_VERSION") for k, a in ins):
        out.append("Dockerfile: no CUDA_VERSION build argument")
    base = next((a for k, a in final if k == "FROM"), "")
    if "nvidia/cuda:${CUDA_VERSION}" not in base or "runtime" not in base:
        out.append(f"Dockerfile: final stage is not a CUDA runtime base by CUDA_VERSION: {base}")
    runs = " ".join(a for k, a in ins if k == "RUN")
    out += _unpinned_installs(ins)
    if not re.search(r"\b(rdma-core|libibverbs1)\b", runs):
        out.append("Dockerfile: no RDMA user space (rdma-core / libibverbs1) for UCX")
    users = [a for k, a in final if k == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        out.append("Dockerfile: the final stage must end as a non-root USER")
    out += _entry_problems(final)
    exposed = " ".join(a for k, a in final if k == "EXPOSE")
    for port in (HTTP_PORT, BOOTSTRAP_PORT):
        if not re.search(rf"\b{port}\b", exposed):
            out.append(f"Dockerfile: port {port} is not EXPOSEd")
    health = next((a for k, a in final if k == "HEALTHCHECK"), "")
    if "/health" not in health:
        out.append("Dockerfile: no HEALTHCHECK on /health")
    return out


def _unpinned_installs(ins: list[tuple[str, str]]) -> list[str]:
    """Every `pip install` outside the router stage takes the lock (-r/-c) or --no-deps."""
    out, stage = [], ""
    for kind, args in ins:
        if kind == "FROM":
            stage = args
        if kind != "RUN" or " AS router" in stage:
            continue
        for step in re.split(r"&&|;", args):
            if "pip install" in step and not re.search(
                r"(-r|-c)\s+\S*requirements\.lock|--no-deps", step
            ):
                out.append(f"Dockerfile: `{step.strip()}` does not take deploy/requirements.lock")
    return out


def _final_stage(ins: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (k, _) in enumerate(ins) if k == "FROM"]
    return ins[starts[-1]:] if starts else ins


def _entry_problems(final: list[tuple[str, str]]) -> list[str]:
    def exec_form(kind: str) -> list[str]:
        args = next((a for k, a in reversed(final) if k == kind), "[]")
        try:
            return list(json.loads(args))
        except json.JSONDecodeError:
            return ["<shell form>"]

    argv = exec_form("ENTRYPOINT") + exec_form("CMD")
    if len(argv) < 2 or not argv[0].endswith("decode-worker") or argv[1] != "serve":
        return [f"Dockerfile: ENTRYPOINT + CMD must run `decode-worker serve`, got {argv}"]
    return []


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """systemd unit -> section -> [(key, value)] in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif "=" in line and current is not None:
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
        else:
            raise ValueError(f"line {number}: not a section header or key=value: {raw!r}")
    return sections


def env_file(path: Path = ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile (comments and blanks skipped)."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def unit_problems(path: Path = UNIT, env_path: Path = ENV_FILE) -> list[str]:
    """The unit rules of issue 8: env file, restart, stop timeout > drain, memlock, serve."""
    try:
        unit = parse_unit(path.read_text())
    except ValueError as exc:
        return [f"{path.name}: {exc}"]
    service = dict(unit.get("Service", []))
    out = [f"{path.name}: no [{s}] section" for s in ("Unit", "Service", "Install")
           if s not in unit]
    if not any(k == "EnvironmentFile" for k, _ in unit.get("Service", [])):
        out.append(f"{path.name}: no EnvironmentFile")
    if service.get("Restart") not in ("on-failure", "always", "on-abnormal"):
        out.append(f"{path.name}: Restart= must restart a failed worker")
    if service.get("LimitMEMLOCK") != "infinity":
        out.append(f"{path.name}: LimitMEMLOCK must be infinity (RDMA registration)")
    if "decode-worker serve" not in service.get("ExecStart", ""):
        out.append(f"{path.name}: ExecStart must run `decode-worker serve`")
    if service.get("User") in (None, "root"):
        out.append(f"{path.name}: run as a dedicated User=, not root")
    announce, grace = drain.drain_s(env_file(env_path))
    stop = unit_stop_s(path)
    if stop is None:
        out.append(f"{path.name}: TimeoutStopSec {service.get('TimeoutStopSec')} is not a time")
    else:
        out += drain.stop_problem(path.name, stop, announce, grace, "TimeoutStopSec")
    out += _device_sandbox_problems(path.name, service)
    return out


def unit_stop_s(path: Path = UNIT) -> float | None:
    """The unit's TimeoutStopSec in seconds (systemd's default 90 s when unset); None when it
    does not parse."""
    service = dict(parse_unit(path.read_text()).get("Service", []))
    return _seconds(service.get("TimeoutStopSec", "90"))


def _device_sandbox_problems(name: str, service: dict[str, str]) -> list[str]:
    """Settings that close the device policy and so hide /dev/nvidia* and /dev/infiniband/*."""
    out = []
    for key in ("PrivateDevices", "ProtectClock"):
        if service.get(key, "no").lower() in ("yes", "true", "1", "on"):
            out.append(f"{name}: {key}=yes hides the GPU and RDMA devices")
    if service.get("DevicePolicy", "auto") != "auto" or "DeviceAllow" in service:
        out.append(f"{name}: DevicePolicy/DeviceAllow restrict the GPU and RDMA devices")
    return out


def _seconds(value: str) -> float | None:
    total, units = 0.0, {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    if not parts or "".join(n + u for n, u in parts) != value.replace(" ", ""):
        return None
    for number, unit in parts:
        if unit not in units:
            return None
        total += float(number) * units[unit]
    return total


def lock_problems(path: Path = LOCK, pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """Every runtime dependency of pyproject.toml pinned (==) in the lock, inside its range."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            spec = next(iter(req.specifier), None)
            if spec is None or spec.operator != "==":
                return [f"{path.name}: {line} is not pinned with =="]
            pins[canonicalize_name(req.name)] = spec.version
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = []
    for dep in map(Requirement, deps):
        pinned = pins.get(canonicalize_name(dep.name))
        if pinned is None:
            out.append(f"{path.name}: {dep.name} (from pyproject.toml) is not pinned")
        elif not dep.specifier.contains(pinned, prereleases=True):
            out.append(f"{path.name}: {dep.name}=={pinned} is outside {dep.specifier}")
    return out
