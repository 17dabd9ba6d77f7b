"""Every benchmark and helper in scripts/ answers `--help` as a plain file, from any directory and
without PYTHONPATH (README: "the Python ones run as files"), and `bench_serving.sh --help` (or a
wrong argument) prints its usage without installing or starting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))


def _plain_env(tmp_path: Path) -> dict[str, str]:
    """No PYTHONPATH (the package comes from its install, as for an operator) and a HOME of its
    own (nothing may be written on --help)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "HOME": str(tmp_path / "home")}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_answers_help_as_a_plain_file(script: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"],
                          cwd=tmp_path, env=_plain_env(tmp_path), capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), f"{script} --help printed nothing"
    assert not (tmp_path / "home").exists(), f"{script} --help wrote under HOME"


@pytest.mark.parametrize(("args", "code"), [(["--help"], 0), (["-h"], 0), (["--prompts", "3"], 2)])
def test_bench_serving_prints_usage_and_starts_nothing(
        args: list[str], code: int, tmp_path: Path) -> None:
    env = {**_plain_env(tmp_path), "BENCH_OUT": str(tmp_path / "out"),
           "BENCH_VENV": str(tmp_path / "venv"), "SGLANG_VENV": str(tmp_path / "sglang"),
           "PYTHON": "/bin/false"}  # any Python it ran would fail the run
    done = subprocess.run(["bash", str(ROOT / "scripts" / "bench_serving.sh"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == code, done.stderr
    usage = done.stdout if code == 0 else done.stderr
    assert "usage: bash scripts/bench_serving.sh" in usage
    assert "NUM_PROMPTS" in usage and "CONCURRENCY" in usage
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no venv, no output, no HOME
