"""The pure core imports with torch, numpy, zmq, nixl and prometheus_client blocked."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import decode_worker.core

BLOCKED = ("torch", "numpy", "zmq", "nixl", "prometheus_client", "msgspec", "pydantic", "asyncio")


def test_core_imports_with_heavy_modules_blocked() -> None:
    core_dir = Path(decode_worker.core.__file__).parent
    modules = [f"decode_worker.core.{m.name}" for m in pkgutil.iter_modules([str(core_dir)])]
    assert modules, "core has no modules"
    code = (
        "import sys\n"
        f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
        f"for mod in {modules!r}: __import__(mod)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_blocking_really_blocks() -> None:
    code = "import sys\nsys.modules['torch'] = None\nimport torch\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
