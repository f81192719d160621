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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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


# ---- folders: no cycles, and every module-scope import runs down the documented layers ----------------

# tidal's folders (and top-level modules) from the bottom layer up; a folder imports (at module scope)
# only folders of lower layers. docs/architecture.md §2 draws this list (``render_layers``), and the
# test below keeps the drawing and the list equal. A new folder gets a place here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("accel", "algorithms", "config", "lazy"),
    ("data", "logging"),
    ("distributed", "rollout"),
    ("checkpoint", "models", "serve", "testing"),
    ("rewards",),
    ("agents", "inference"),
    ("experience",),
    ("placement",),
    ("trainers",),
    ("cli",),
)


def folder(module: str) -> str:
    """``tidal.x.y`` → ``x`` (a top-level module ``tidal.accel`` is its own folder ``accel``)."""
    return module.split(".")[1]


def module_scope_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: its top-level statements, inside ``if``/``try``
    blocks too, but not ``if TYPE_CHECKING:`` (never run) nor function bodies (run when called)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(block)

    visit(tree.body)
    return found


def folder_edges(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """``(importer folder, imported folder)`` → the module-scope imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        importer = module_name(path, package.parent)
        if importer.count(".") < 1:  # tidal/__init__.py
            continue
        for node in module_scope_imports(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [resolve(node, importer, path.name == "__init__.py")]
            )
            for target in names:
                if target.startswith("tidal.") and folder(target) != folder(importer):
                    edges.setdefault((folder(importer), folder(target)), []).append(f"{importer} -> {target}")
    return edges


def layering_problems(edges: dict[tuple[str, str], list[str]], layers=LAYERS) -> list[str]:
    """One line per import that does not run down the layers, and per folder the layers do not place."""
    layer = {name: i for i, names in enumerate(layers) for name in names}
    problems = [
        f"{name}: not in LAYERS (tests/test_imports.py)" for name in sorted({*sum(edges, ())} - set(layer))
    ]
    for (a, b), imports in sorted(edges.items()):
        if a in layer and b in layer and layer[b] >= layer[a]:
            problems.append(f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]}): {imports[0]}")
    return problems


def render_layers(layers=LAYERS) -> str:
    """The layer drawing in docs/architecture.md §2: the top layer first, ``↓`` meaning "imports"."""
    rows = [" · ".join(names) for names in reversed(layers)]
    return "\n   ↓\n".join(rows)


def test_folder_graph_sees_module_scope_imports_only(tmp_path):
    pkg = tmp_path / "tidal"
    for name in ("low", "high"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from tidal.high import x\n"
        "def f():\n    from tidal.high import y\n"
    )
    (pkg / "high" / "b.py").write_text("try:\n    from ..low import a\nexcept ImportError:\n    pass\n")
    edges = folder_edges(pkg)
    assert edges == {("high", "low"): ["tidal.high.b -> tidal.low"]}
    assert layering_problems(edges, (("low",), ("high",))) == []
    assert layering_problems(edges, (("high",), ("low",))) == [
        "high (layer 0) imports low (layer 1): tidal.high.b -> tidal.low"
    ]
    assert layering_problems(edges, (("low", "high"),))[0].startswith("high (layer 0) imports low (layer 0)")


def test_no_folder_imports_a_folder_that_imports_it():
    edges = folder_edges()
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    cycle = find_cycle(graph)
    assert cycle is None, (
        "folder cycle: "
        + " -> ".join(cycle)
        + "; e.g. "
        + "; ".join(edges[(a, b)][0] for a, b in zip(cycle, cycle[1:], strict=False))
    )


def test_imports_run_down_the_documented_layers():
    problems = layering_problems(folder_edges())
    assert not problems, "\n".join(problems)
    folders = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or any(p.glob("*.py"))} - {"__init__"}
    placed = {name for names in LAYERS for name in names}
    assert folders - placed == set(), "place these folders in LAYERS"


def test_architecture_md_draws_the_layers():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert render_layers() in doc, "docs/architecture.md §2: redraw the layers as render_layers() prints them"
