"""The shape of the package: no import cycles, no module taking another's private names.

Read from the source with ``ast`` (nothing is imported), so the test covers every
module of ``cudakit``, packages included, whatever other work adds later.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cudakit

ROOT = Path(cudakit.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of the module a ``from ... import`` reads."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not _is_package(path):
        base.pop()  # a module's relative imports start at its package
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, list[str], int]]:
    """(importer, imported module, names, line) for every ``cudakit`` import, top level or not.

    ``from . import x`` where ``x`` is a submodule counts as importing ``x``.
    """
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(name, path, node)
                if not target.startswith("cudakit"):
                    continue
                names = [a.name for a in node.names]
                subs = [n for n in names if f"{target}.{n}" in modules]
                for sub in subs:
                    found.append((name, f"{target}.{sub}", [], node.lineno))
                rest = [n for n in names if n not in subs]
                if rest or not subs:
                    found.append((name, target, rest, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("cudakit"):
                        found.append((name, alias.name, [], node.lineno))
    return found


def _is_type_checking_only(path: Path, line: int) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            inner = {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
            if line in inner:
                return True
    return False


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def _graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Who imports whom at import time (``type_checking``: the imports under
    ``if TYPE_CHECKING:`` too)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for importer, imported, _, line in _imports(modules):
        if imported not in modules or imported == importer:
            continue
        if not type_checking and _is_type_checking_only(modules[importer], line):
            continue  # never runs: cannot form a cycle at import time
        graph[importer].add(imported)
    return graph


def test_the_walk_sees_the_package() -> None:
    graph = _graph()
    assert "cudakit" in graph
    assert "cudakit.parallel" in graph
    assert any(graph.values())


def test_no_import_cycles() -> None:
    graph = _graph()
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_hidden_under_type_checking() -> None:
    # Two modules that each need the other's types are one concern in two files, or
    # one of them should be typed against what it uses (a Protocol, the parts passed in).
    cycle = _find_cycle(_graph(type_checking=True))
    assert cycle is None, "import cycle under TYPE_CHECKING: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_another_modules_private_names() -> None:
    """``from .x import _name`` is allowed only from a private module (``_check``, ``_dist``)."""
    modules = _modules()
    offenders = []
    for importer, imported, names, line in _imports(modules):
        if imported == importer or imported not in modules:
            continue
        if _private(imported.rsplit(".", 1)[-1]):
            continue  # a private shared module: its public names are for the package
        bad = [n for n in names if _private(n)]
        if bad:
            offenders.append(f"{importer}:{line} imports {bad} from {imported}")
    assert not offenders, "\n".join(offenders)


def test_relative_imports_resolve() -> None:
    modules = _modules()
    path = modules["cudakit.parallel.wrap"]
    node = ast.ImportFrom(module="group", names=[ast.alias("x")], level=1)
    assert _resolve("cudakit.parallel.wrap", path, node) == "cudakit.parallel.group"
    node = ast.ImportFrom(module="_dist", names=[ast.alias("x")], level=2)
    assert _resolve("cudakit.parallel.wrap", path, node) == "cudakit._dist"
    init = modules["cudakit.parallel"]
    node = ast.ImportFrom(module="wrap", names=[ast.alias("x")], level=1)
    assert _resolve("cudakit.parallel", init, node) == "cudakit.parallel.wrap"


def _own_private_attributes(path: Path) -> set[str]:
    """The ``self._name`` attributes a module's classes set: their private state."""
    return {
        node.attr
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and _private(node.attr)
    }


def test_no_other_package_reads_an_autocast_steps_private_state() -> None:
    """``speed_report`` and ``Checkpointer`` read the window through ``step.window``."""
    private = _own_private_attributes(ROOT / "amp" / "step.py")
    assert "_window" in private
    offenders = []
    for name, path in _modules().items():
        if name.startswith("cudakit.amp"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)
