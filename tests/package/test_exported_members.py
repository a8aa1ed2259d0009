"""The public surface: ``__all__`` is sorted, complete and documented (after httpx)."""

from __future__ import annotations

import types

import cudakit


def test_all_is_sorted() -> None:
    assert list(cudakit.__all__) == sorted(cudakit.__all__)


def test_all_matches_exports() -> None:
    exported = {
        name
        for name, value in vars(cudakit).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert exported | {"__version__"} == set(cudakit.__all__)


def test_every_export_has_a_docstring() -> None:
    missing = []
    for name in cudakit.__all__:
        if name in ("__version__", "DeviceLike"):
            continue
        if not (getattr(cudakit, name).__doc__ or "").strip():
            missing.append(name)
    assert not missing, f"exports without a docstring: {missing}"
