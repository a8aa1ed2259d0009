"""A package's ``__all__`` holds only public names, each one on an API page.

An internal (a log target, a worker cap, a hidden protocol's helper) stays in the
module that owns it; what a public signature names is documented from that module
(``::: cudakit.memory.reporter.STDERR``), not re-exported by the package.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import cudakit

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api"

#: The public packages, each documented on the API pages: every package of cudakit
#: whose name does not start with ``_``, so a new one is checked the day it is added.
PACKAGES = (
    "cudakit",
    *sorted(
        f"cudakit.{m.name}"
        for m in pkgutil.iter_modules(cudakit.__path__)
        if m.ispkg and not m.name.startswith("_")
    ),
)

#: Internals that once sat in a package's ``__all__``, and where they live now.
INTERNALS = {
    "cudakit.amp": ("WatchOptions",),  # cudakit.amp.watch
    "cudakit.memory": ("STDERR", "Stderr", "LogTarget"),  # cudakit.memory.reporter
    "cudakit.warmup": ("is_oom_error",),  # cudakit._oom
    "cudakit.data": ("MAX_AUTO_WORKERS", "SizedIterable"),  # cudakit.data.loaders, .prefetcher
}


def _documented() -> set[str]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    return set(re.findall(r"^::: (cudakit[\w.]*)", text, re.MULTILINE))


@pytest.mark.parametrize("name", PACKAGES)
def test_every_export_is_on_an_api_page(name: str) -> None:
    documented = _documented()
    package = importlib.import_module(name)
    missing = [
        n
        for n in package.__all__
        if n != "__version__" and not any(d.endswith(f".{n}") for d in documented)
    ]
    assert not missing, f"{name}.__all__ names what no API page documents: {missing}"


@pytest.mark.parametrize(("name", "internals"), sorted(INTERNALS.items()))
def test_internals_stay_out_of_the_package(name: str, internals: tuple[str, ...]) -> None:
    package = importlib.import_module(name)
    assert not set(internals) & set(package.__all__)
    assert not [n for n in internals if n in vars(package)]


def test_watch_options_is_documented_where_it_lives() -> None:
    from cudakit.amp.watch import WatchOptions

    assert "cudakit.amp.watch.WatchOptions" in _documented()
    assert "skip_spikes" in WatchOptions.__annotations__
