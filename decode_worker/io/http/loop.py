"""Event loop choice: uvloop where it is installed, the default asyncio loop otherwise."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def has_uvloop() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def run(main: Coroutine[Any, Any, T], use_uvloop: bool = True) -> T:
    """Run `main` to completion on uvloop if available (and wanted), else on asyncio's loop."""
    if use_uvloop and has_uvloop():
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
