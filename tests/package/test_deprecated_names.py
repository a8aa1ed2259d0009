"""Renamed public names answer under their old name for one release, with a warning."""

from __future__ import annotations

import importlib

import pytest

import cudakit
from cudakit.memory import MemoryMeter
from cudakit.parallel.strategy import choose_plan
from cudakit.speed import SpeedMeter

OLD_NAMES = [
    ("cudakit", "SpeedReport", SpeedMeter),
    ("cudakit.speed", "SpeedReport", SpeedMeter),
    ("cudakit.speed.meter", "SpeedReport", SpeedMeter),
    ("cudakit.memory", "MemoryReporter", MemoryMeter),
    ("cudakit.memory.reporter", "MemoryReporter", MemoryMeter),
    ("cudakit.parallel.strategy", "plan_parallel", choose_plan),
]


@pytest.mark.parametrize(("module", "old", "new"), OLD_NAMES)
def test_an_old_name_warns_and_gives_the_new_object(module: str, old: str, new: object) -> None:
    mod = importlib.import_module(module)
    new_name = getattr(new, "__name__", "")
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is deprecated") as seen:
        assert getattr(mod, old) is new
    assert str(seen[0].message) == (
        f"{module}.{old} is deprecated: it is called {module}.{new_name} now; the old name "
        "goes in the next release."
    )
    assert seen[0].filename == __file__  # points at the code that used the old name


@pytest.mark.parametrize(("module", "old", "new"), OLD_NAMES)
def test_an_old_name_is_not_exported(module: str, old: str, new: object) -> None:
    assert old not in importlib.import_module(module).__all__


def test_the_old_name_imports_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="cudakit.SpeedReport is deprecated"):
        from cudakit import SpeedReport  # noqa: F401


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'cudakit' has no attribute 'SpeedRep'"):
        cudakit.SpeedRep  # type: ignore[attr-defined]  # noqa: B018
