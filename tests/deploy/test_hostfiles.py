"""Dockerfile, systemd unit, environment file and lock follow the deployment rules."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.deploy_check import REPO, hostfiles, policy

UNIT_TEXT = hostfiles.UNIT.read_text()
DOCKER_TEXT = hostfiles.DOCKERFILE.read_text()


def test_shipped_files_are_clean() -> None:
    assert hostfiles.dockerfile_problems() == []
    assert hostfiles.unit_problems() == []
    assert hostfiles.lock_problems() == []


def test_env_file_holds_valid_settings() -> None:
    env = hostfiles.env_file()
    assert env["DECODE_WORKER_SERVER__HOST"] == "0.0.0.0"
    assert policy.settings_problems("decode-worker.env", env) == []


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("USER 10001:10001", "USER root", "non-root USER"),
    ('CMD ["serve"]', 'CMD ["prefill"]', "decode-worker serve"),
    ("HEALTHCHECK", "# HEALTHCHECK", "HEALTHCHECK"),
    ("EXPOSE 30000/tcp 8998/tcp", "EXPOSE 8998/tcp", "30000"),
    ("-r deploy/requirements.lock", ".", "lock"),
    ("ARG CUDA_VERSION=12.8.1", "ARG CUDA=12.8.1", "CUDA_VERSION"),
])
def test_dockerfile_rules_catch_breakage(tmp_path: Path, old: str, new: str,
                                         expected: str) -> None:
    assert old in DOCKER_TEXT
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKER_TEXT.replace(old, new))
    problems = hostfiles.dockerfile_problems(broken)
    assert any(expected in p for p in problems), problems


def test_dockerfile_continuations_are_joined() -> None:
    ins = hostfiles.dockerfile_instructions("FROM a\nRUN x \\\n  # note\n  && y\nUSER 1\n")
    assert ins == [("FROM", "a"), ("RUN", "x  && y"), ("USER", "1")]


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("TimeoutStopSec=60", "TimeoutStopSec=20", "TimeoutStopSec"),
    ("LimitMEMLOCK=infinity", "LimitMEMLOCK=64K", "LimitMEMLOCK"),
    ("Restart=on-failure", "Restart=no", "Restart"),
    ("EnvironmentFile=/etc/decode-worker/decode-worker.env\n", "", None),
    ("[Install]", "Install", "not a section header"),
    ("NoNewPrivileges=yes", "NoNewPrivileges=yes\nProtectClock=yes", "ProtectClock"),
    ("NoNewPrivileges=yes", "NoNewPrivileges=yes\nDevicePolicy=closed", "DevicePolicy"),
])
def test_unit_rules_catch_breakage(tmp_path: Path, old: str, new: str,
                                   expected: str | None) -> None:
    assert old in UNIT_TEXT
    broken = tmp_path / "decode-worker@.service"
    broken.write_text(UNIT_TEXT.replace(old, new))
    problems = hostfiles.unit_problems(broken)
    # Without the shared file the optional per-instance file remains: still an EnvironmentFile.
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


def test_stop_timeout_must_exceed_the_drain_in_the_env_file(tmp_path: Path) -> None:
    env = tmp_path / "decode-worker.env"
    env.write_text(hostfiles.ENV_FILE.read_text().replace(
        "DRAIN_GRACE_S=30", "DRAIN_GRACE_S=90"))
    problems = hostfiles.unit_problems(env_path=env)
    assert any("TimeoutStopSec" in p for p in problems), problems


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    unit = tmp_path / "decode-worker@.service"
    unit.write_text(UNIT_TEXT.replace("ExecStart=/opt/decode-worker/bin/decode-worker",
                                      "ExecStart=/bin/true"))
    (tmp_path / "decode-worker@0.service").symlink_to(unit.name)
    done = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "decode-worker@0.service")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stderr


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint_passes() -> None:
    done = subprocess.run(["hadolint", "--config", "deploy/hadolint.yaml", "Dockerfile"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_lock_must_pin_every_dependency(tmp_path: Path) -> None:
    text = hostfiles.LOCK.read_text()
    lock = tmp_path / "requirements.lock"
    lock.write_text(text.replace("msgspec==", "# msgspec=="))
    assert any("msgspec" in p for p in hostfiles.lock_problems(lock))
    lock.write_text(text.replace("torch==2.13.0", "torch==2.0.0"))
    assert any("outside" in p for p in hostfiles.lock_problems(lock))
    lock.write_text(text.replace("numpy==2.4.6", "numpy>=2"))
    assert any("not pinned" in p for p in hostfiles.lock_problems(lock))
