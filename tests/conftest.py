"""Shared fixtures and the GPU auto-skip."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


# Triton kernels run on CPU under Triton's interpreter (numpy per block): it must be chosen before
# triton is imported, so here, before any test module loads. A CUDA machine runs them compiled.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # servers the tests start share one card (up to four at once per pytest process: prefill
    # peers, decode workers, the test process's own engine; pytest-xdist runs several such
    # processes): each gets its own share of the device
    from decode_worker.core.memory_budget import colocated_share

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("DECODE_WORKER_CACHE__MEMORY_FRACTION", str(colocated_share(4 * workers)))


# Servers that tests/e2e/conftest.py shares between test files: under pytest-xdist the files
# that use one run on one worker (one start, not one per worker).
SHARED_SERVERS = ("plain_live", "plain_pd", "plain_routed")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _xdist_groups(config):
        _group_by_file(items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _xdist_groups(config: pytest.Config) -> bool:
    """Whether this is a pytest-xdist worker under `--dist loadgroup` (xdist tells its workers
    `loadgroup`, their own `dist` is "no")."""
    return bool(getattr(config.option, "loadgroup", False))


def _group_by_file(items: list[pytest.Item]) -> None:
    """`--dist loadgroup` keeps each group on one worker, in file order: a group is a test
    file (its module fixtures built once, its tests in order), or every file that uses one of
    the SHARED_SERVERS. Groups with a `slow` test go first (scripts/test.sh turns off xdist's
    own order, most tests first): a long one-test file (the soak) started last would leave the
    other worker idle at the end."""
    files: dict[str, set[str]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], set()).update(
            f for f in SHARED_SERVERS if f in getattr(item, "fixturenames", ()))
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        shared = files[item.nodeid.split("::")[0]]
        name = min(shared) if shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(name))
        groups.setdefault(name, []).append(item)
    ordered = sorted(groups.values(), key=lambda g: not any("slow" in i.keywords for i in g))
    items[:] = [item for group in ordered for item in group]


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """family -> a tiny checkpoint of it written by transformers (tests/families.py), written
    once per session on first use and shared by every test that asks."""
    made: dict[str, object] = {}

    def get(family: str):  # type: ignore[no-untyped-def]
        if family not in made:
            from tests.families import write_hf_checkpoint

            made[family] = write_hf_checkpoint(tmp_path_factory.mktemp(family) / "model", family)
        return made[family]

    return get
