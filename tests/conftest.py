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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
