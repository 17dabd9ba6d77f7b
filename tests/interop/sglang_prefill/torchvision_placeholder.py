"""Inert stand-in for `torchvision`, installed as `torchvision/__init__.py` in the SGLang venv.

Written there by scripts/setup_sglang.sh; never imported by the main environment.

Why: PyPI's torchvision wheels do not load beside torch 2.13.0+cpu ("operator torchvision::nms
does not exist"), yet `sglang.srt` imports `torchvision.transforms` at module level
(multimodal/internvl_utils.py, reached from sglang.srt.configs), and transformers, seeing a
`torchvision` package, imports `torchvision.io` / `torchvision.transforms` names at module level
(image_utils.py). Nothing on the PD transfer path ever calls into torchvision, so every
submodule import succeeds and every attribute is an inert class; constructing or calling one
raises, so an accidental real use fails loudly instead of computing garbage.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+placeholder"
# scripts/setup_sglang.sh rewrites this file when the number differs
PLACEHOLDER_REVISION = 1


def _refuse(name: str) -> NoReturn:
    raise RuntimeError(f"{name}: torchvision is an inert placeholder in this environment")


class _InertMeta(type):
    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _inert(f"{cls.__qualname__}.{attr}")

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(cls.__qualname__)


def _inert(name: str) -> type:
    return _InertMeta(name, (), {"__qualname__": name})


class _InertModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _inert(f"{self.__name__}.{attr}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _InertModule(spec.name)
        module.__path__ = []  # a package, so deeper submodules resolve through us too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


if __name__ == "torchvision" and not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())


def __getattr__(attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _inert(f"{__name__}.{attr}")
