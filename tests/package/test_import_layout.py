"""The shape of the package: no import cycles, no module taking another's private names.

Module-level imports only (an import inside a function or under ``TYPE_CHECKING`` runs
late and cannot make a cycle at import time). Importing a private *module*
(``from . import _probes``) is how shared machinery is reached; importing a private
*name* from another module is not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "cudakit"


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["cudakit", *parts])


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _module_level_imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(absolute module, imported names)`` for every top-level ``import``/``from``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _name(path)
    package = me if _is_package(path) else me.rpartition(".")[0]
    out: list[tuple[str, list[str]]] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in ROOT.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for module, names in _module_level_imports(path):
            # `from . import _probes` names a submodule: the dependency is that module.
            subs = {f"{module}.{n}" for n in names if f"{module}.{n}" in modules}
            deps.update(subs)
            if module in modules and (not names or len(subs) < len(names)):
                deps.add(module)
        graph[name] = deps - {name}
    return graph


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_takes_another_modules_private_names(name: str) -> None:
    path = _modules()[name]
    taken = [
        f"{module}.{n}"
        for module, names in _module_level_imports(path)
        if module.startswith("cudakit") and module != name
        for n in names
        if n.startswith("_")
        and not n.startswith("__")  # __version__
        and f"{module}.{n}" not in _modules()  # a private *module* is fine
    ]
    assert not taken, f"{name} imports private names: {taken}"
