"""Helpers for the deploy tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


def edit_yaml(path: Path, kind: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply `change` to the first document of `kind` in the YAML file at `path`."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    target = next(d for d in docs if d["kind"] == kind)
    change(target)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
