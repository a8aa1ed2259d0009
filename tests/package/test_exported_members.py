"""The public surface of every package: ``__init__`` only re-exports, and ``__all__`` is
sorted, complete and documented (after httpx ``tests/test_exported_members.py``).

Every package of ``cudakit`` is checked, private ones (``cudakit._tree``) too, whatever
later work adds.
"""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

import cudakit

ROOT = Path(cudakit.__file__).parent
PACKAGES = sorted(
    ".".join(["cudakit", *p.parent.relative_to(ROOT).parts]) for p in ROOT.rglob("__init__.py")
)
#: Type aliases: their ``__doc__`` is typing's; a ``#:`` comment describes them.
ALIASES = {"DeviceLike", "Phase", "Statistic", "Strategy", "StrategyRequest"}


def _ruff_order(names: list[str]) -> list[str]:
    """ruff's RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical."""
    return sorted(names, key=lambda n: (not n.isupper(), not n[:1].isupper(), n))


def test_every_package_is_checked() -> None:
    assert {"cudakit", "cudakit._tree", "cudakit.amp", "cudakit.parallel"} <= set(PACKAGES)
    assert len(PACKAGES) >= 11


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted(name: str) -> None:
    package = importlib.import_module(name)
    assert list(package.__all__) == _ruff_order(list(package.__all__))


@pytest.mark.parametrize("name", PACKAGES)
def test_all_matches_exports(name: str) -> None:
    package = importlib.import_module(name)
    exported = {
        key
        for key, value in vars(package).items()
        if not key.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exported == set(package.__all__) - {"__version__"}


@pytest.mark.parametrize("name", PACKAGES)
def test_every_export_has_a_docstring(name: str) -> None:
    package = importlib.import_module(name)
    missing = [
        n
        for n in package.__all__
        if n not in ALIASES
        and n != "__version__"
        and not (getattr(package, n).__doc__ or "").strip()
    ]
    assert not missing, f"{name} exports without a docstring: {missing}"


@pytest.mark.parametrize("name", PACKAGES)
def test_init_only_reexports(name: str) -> None:
    """A docstring, imports, ``__all__``, and the ``__getattr__`` of deprecated names."""
    path = ROOT.joinpath(*name.split(".")[1:], "__init__.py")
    for node in ast.parse(path.read_text()).body:
        is_docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        is_import = isinstance(node, (ast.Import, ast.ImportFrom))
        is_assign = isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) in (
            "__all__",
            "__getattr__",
        )
        assert is_docstring or is_import or is_assign, f"{name}: {ast.unparse(node)}"
