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
    # servers the tests start share one card (up to four at once: prefill peers, decode
    # workers, the test process's own engine): each gets its own share of the device
    from decode_worker.core.memory_budget import colocated_share

    os.environ.setdefault("DECODE_WORKER_CACHE__MEMORY_FRACTION", str(colocated_share(4)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
