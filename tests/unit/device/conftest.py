"""The device tests' background runs. The two sm_90 compile checks are subprocesses of tens of
seconds each (Triton's compiler and ptxas, no GPU needed): they start as the first device test
starts, when selected, and run beside the interpreter tests, which keep one core busy; each
compile test then collects its own run (under pytest-xdist, starts it: the other worker is the
one beside it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MOE_TEST = "test_moe_kernels_compile_for_sm90_at_decode_and_prefill_sizes"
ATTENTION_TEST = "test_the_kernels_compile_for_an_h200"
Spec = tuple[list[str], dict[str, str], float]  # argv, env, timeout (s)


def _has_ptxas() -> bool:
    """Whether the installed triton bundles ptxas (the MoE compile test skips without it)."""
    spec = importlib.util.find_spec("triton")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    return bool(dirs) and (Path(dirs[0]) / "backends" / "nvidia" / "bin" / "ptxas").exists()


def _run(argv: list[str], env: dict[str, str], timeout_s: float,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


class Runs:
    """The compile runs by name: `runs[name]` is the run's future, started then if it was not
    started before (`start_all`)."""

    def __init__(self, pool: ThreadPoolExecutor, specs: dict[str, Spec]) -> None:
        self._pool, self._specs = pool, specs
        self._started: dict[str, Future[subprocess.CompletedProcess[str]]] = {}

    def __getitem__(self, name: str) -> Future[subprocess.CompletedProcess[str]]:
        if name not in self._started:
            argv, env, timeout_s = self._specs[name]
            self._started[name] = self._pool.submit(_run, argv, env, timeout_s)
        return self._started[name]

    def start_all(self) -> None:
        for name in self._specs:
            self[name]


@pytest.fixture(scope="session", autouse=True)
def sm90_compiles(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """"moe" (scripts/compile_moe_kernels.py at decode and prefill sizes) and "attention"
    (tests/unit/device/sm90_compile.py, compiled for real: a fresh TRITON_CACHE_DIR), for the
    compile tests this session selected. Under pytest-xdist each worker collects every test but
    runs only some: a run starts when its test asks for it, while the other worker goes on."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    specs: dict[str, Spec] = {}
    if MOE_TEST in selected and _has_ptxas():
        specs["moe"] = ([sys.executable, "scripts/compile_moe_kernels.py", "--tokens",
                         "1,256,4096"], dict(os.environ), 240)
    if ATTENTION_TEST in selected:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
        specs["attention"] = ([sys.executable, "-m", "tests.unit.device.sm90_compile"], env, 300)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = Runs(pool, specs)
        if "PYTEST_XDIST_WORKER" not in os.environ:
            runs.start_all()
        yield runs
