"""Fixtures for the deploy checks: a scratch copy of deploy/k8s to break on purpose."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts.deploy_check import K8S


@pytest.fixture
def k8s_copy(tmp_path: Path) -> Path:
    """A copy of deploy/k8s (schemas included) under tmp_path."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    return root
