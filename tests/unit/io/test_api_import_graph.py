"""`io/api` has no import cycle, and only the package's `__init__` imports `app.py` (the
endpoints take the `ApiContext` Protocol instead), read from the source like test_layers."""

from __future__ import annotations

from pathlib import Path

import decode_worker.io.api as api
from tests.unit.test_layers import imported_modules

PKG = "decode_worker.io.api"
DIR = Path(api.__file__).parent


def api_import_graph() -> dict[str, set[str]]:
    """Module name (no package prefix) -> the io/api modules it imports, TYPE_CHECKING too."""
    modules = {f.stem for f in DIR.glob("*.py") if f.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        names = imported_modules(DIR / f"{name}.py")
        graph[name] = {n.removeprefix(PKG + ".") for n in names if n.startswith(PKG + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_io_api_has_no_import_cycle() -> None:
    graph = api_import_graph()
    assert {"app", "generate", "openai", "admin", "context"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_module_of_io_api_imports_the_app() -> None:
    assert [name for name, deps in api_import_graph().items() if "app" in deps] == []


def test_the_cycle_search_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
