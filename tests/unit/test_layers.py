"""The layer rules of docs/CONTRACTS.md, read from the source: device and io never import each
other, io never imports torch, device never imports the network stack, neither imports daemon."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import decode_worker

PKG = Path(decode_worker.__file__).parent
FORBIDDEN = {
    "device": ("decode_worker.io", "decode_worker.daemon", "zmq", "nixl", "asyncio", "msgspec"),
    "io": ("decode_worker.device", "decode_worker.daemon", "torch", "numpy"),
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_follow_the_rules(layer: str) -> None:
    files = sorted((PKG / layer).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(PKG)}: {name}" for f in files for name in imported_modules(f)
           if any(name == x or name.startswith(x + ".") for x in FORBIDDEN[layer])]
    assert not bad, bad


def test_the_scan_sees_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("import torch\nfrom decode_worker.device import kv_pool\n")
    assert {"torch", "decode_worker.device"} <= imported_modules(sample)
