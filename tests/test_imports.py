"""No import cycles in ``tidal``: every module's imports of tidal modules, at any depth, form a DAG.

The graph is built from the source with ``ast`` (nothing is imported): each ``import tidal.x`` and
``from tidal.x import y`` anywhere in a module — at the top, inside functions, under ``TYPE_CHECKING``
— is an edge to the module it names (``y`` too when ``tidal.x.y`` is a module). A function-level
import is still a dependency, so hiding a cycle inside a function does not make it go away.

A package's ``__init__`` is a module like any other: ``from tidal.x.y import z`` first runs
``tidal.x``'s ``__init__``, so it depends on ``tidal.x`` as well — a cycle through a package's
re-exports fails at import time as surely as a direct one. The importer's own packages are the
exception: ``tidal.x.y`` importing ``tidal.x.z`` needs ``tidal.x``, which is already loading by then.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tidal"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module of a ``from`` import (relative ones resolved against ``importer``)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported(path: Path, importer: str, modules: dict[str, Path]) -> set[str]:
    """The tidal modules ``path`` imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = resolve(node, importer, is_package)
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}
    with_packages = {".".join(name.split(".")[:i]) for name in found for i in range(2, name.count(".") + 2)}
    deps = {name for name in with_packages if name in modules}
    return {dep for dep in deps if not importer.startswith(dep + ".")} - {importer}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_every_kind_of_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import tidal.a.b\n"
        "from tidal.c import d\n"
        "def f():\n"
        "    from tidal.e import g\n"
        "if TYPE_CHECKING:\n"
        "    from .h import i\n"
    )
    modules = dict.fromkeys(
        ["tidal.a", "tidal.a.b", "tidal.c", "tidal.c.d", "tidal.e", "tidal.x.h", "tidal.x.m"]
    )
    # a module, its package's __init__, a name that is a module, a function-level and a relative import
    assert imported(source, "tidal.x.m", modules) == {"tidal.a", "tidal.a.b", "tidal.c", "tidal.c.d", "tidal.e",
                                                      "tidal.x.h"}  # fmt: skip
    graph = import_graph()
    assert len(graph) > 100
    assert "tidal.trainers.ppo.trainer" in graph["tidal.trainers.ppo"]


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_tidal():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
