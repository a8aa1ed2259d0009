"""The memory and warm-up packages: ``__all__`` sorted, complete and documented."""

from __future__ import annotations

import importlib
import types

import pytest

PACKAGES = ("cudakit.memory", "cudakit.warmup")


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_matches_the_exports(name: str) -> None:
    package = importlib.import_module(name)
    # ruff's order (RUF022): CONSTANTS, then Classes, then functions, each alphabetical.
    order = sorted(package.__all__, key=lambda n: (not n.isupper(), not n[0].isupper(), n))
    assert list(package.__all__) == order
    exported = {
        key
        for key, value in vars(package).items()
        if not key.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exported == set(package.__all__)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_export_has_a_docstring(name: str) -> None:
    package = importlib.import_module(name)
    missing = [n for n in package.__all__ if not (getattr(package, n).__doc__ or "").strip()]
    assert not missing


def test_example_batch_is_exported_from_cudakit_warmup() -> None:
    from cudakit.warmup import example_batch

    assert example_batch.__module__ == "cudakit.warmup.example"
