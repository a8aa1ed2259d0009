"""The examples in attribute docstrings (a string under ``PEAKS = ...``) run too.

pytest's ``--doctest-modules`` never sees them: Python drops a string that follows an
assignment. mkdocstrings renders them on the API pages, so they are read here from the
source and run as doctests in their module's namespace.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _attribute_docstrings() -> list[tuple[str, str, str, int]]:
    """(module, attribute, docstring, line) for each documented top-level attribute."""
    found = []
    for path in sorted((ROOT / "cudakit").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, after in itertools.pairwise(tree.body):
            if not isinstance(node, ast.Assign | ast.AnnAssign):
                continue
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            doc = after.value if isinstance(after, ast.Expr) else None
            if (
                isinstance(target, ast.Name)
                and isinstance(doc, ast.Constant)
                and isinstance(doc.value, str)
                and ">>>" in doc.value
            ):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found.append((module, target.id, doc.value, after.lineno))
    return found


CASES = _attribute_docstrings()


def test_the_walk_finds_the_peak_table_example() -> None:
    assert ("cudakit.speed.peaks", "PEAKS") in {(m, a) for m, a, _, _ in CASES}


@pytest.mark.parametrize(("module", "name", "doc", "line"), CASES, ids=[c[1] for c in CASES])
def test_attribute_docstring_examples_run(module: str, name: str, doc: str, line: int) -> None:
    namespace = dict(vars(importlib.import_module(module)))
    test = doctest.DocTestParser().get_doctest(doc, namespace, f"{module}.{name}", module, line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.summarize(verbose=False).failed == 0, "".join(out)
