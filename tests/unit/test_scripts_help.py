"""Every benchmark and helper in scripts/ answers `--help` as a plain file, from any directory and
without PYTHONPATH (README: "the Python ones run as files"), and `bench_serving.sh --help` (or a
wrong argument) prints its usage without installing or starting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
HelpRuns = dict[str, tuple[Path, "Future[subprocess.CompletedProcess[str]]"]]


def _plain_env(tmp_path: Path) -> dict[str, str]:
    """No PYTHONPATH (the package comes from its install, as for an operator) and a HOME of its
    own (nothing may be written on --help)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "HOME": str(tmp_path / "home")}


def _help(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"],
                          cwd=cwd, env=_plain_env(cwd), capture_output=True, text=True,
                          timeout=240, check=False)


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelpRuns]:
    """Every script's `--help`, each in a directory of its own, run as the module starts, one
    per core at a time (each mostly imports torch): script -> (its directory, the run)."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        dirs = {s: tmp_path_factory.mktemp(s.removesuffix(".py")) for s in SCRIPTS}
        yield {s: (d, pool.submit(_help, s, d)) for s, d in dirs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_answers_help_as_a_plain_file(script: str, helps: HelpRuns) -> None:
    cwd, run = helps[script]
    done = run.result()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), f"{script} --help printed nothing"
    assert not (cwd / "home").exists(), f"{script} --help wrote under HOME"


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
