"""The device and data packages: re-exports only, documented, no cycles, no private imports."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "cudakit"
PACKAGES = ["cudakit.device", "cudakit.data"]
# The modules of this concern: the two packages and the walker they share.
MINE = ("cudakit.device", "cudakit.data", "cudakit._tree")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) for every cudakit import in a file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("cudakit"):
                found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names if a.name.startswith("cudakit"))
    return found


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def is_mine(name: str) -> bool:
    return name.startswith(("cudakit._tree", "cudakit.device", "cudakit.data"))


@pytest.mark.parametrize("package", PACKAGES)
def test_package_init_only_reexports_a_sorted_documented_all(package: str) -> None:
    mod = importlib.import_module(package)
    # ruff's RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical.
    order = sorted(mod.__all__, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))
    assert list(mod.__all__) == order
    exported = {
        n
        for n, v in vars(mod).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert exported == set(mod.__all__)
    for name in mod.__all__:
        if name != "DeviceLike" and not isinstance(getattr(mod, name), int):
            assert (getattr(mod, name).__doc__ or "").strip(), name
    tree = ast.parse(Path(mod.__file__ or "").read_text())
    for node in tree.body:
        is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        is_all = isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"
        assert is_docstring or is_all or isinstance(node, ast.ImportFrom), ast.unparse(node)


def test_no_import_cycles_through_device_data_or_the_walker() -> None:
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for target, names in imports_of(path):
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            deps.update(submodules)  # `from . import handlers` imports a module
            if target in modules and len(submodules) < len(names or [None]):
                deps.add(target)
        graph[name] = {d for d in deps if d != name}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for dep in graph.get(node, ()):
                if dep == start:
                    return [*path, dep]
                if dep not in path and is_mine(dep):
                    stack.append((dep, [*path, dep]))
        return None

    checked = [name for name in graph if is_mine(name)]
    assert len(checked) == 20  # _tree and its 11 modules, 2 packages, 6 modules
    for name in checked:
        assert cycle_from(name) is None, cycle_from(name)


def test_no_module_imports_another_modules_private_names() -> None:
    modules = all_modules()
    for name, path in modules.items():
        if not is_mine(name):
            continue
        for target, names in imports_of(path):
            private = [
                n
                for n in names
                if n.startswith("_") and n != "__version__" and f"{target}.{n}" not in modules
            ]
            assert not private, f"{name} imports {private} from {target}"
