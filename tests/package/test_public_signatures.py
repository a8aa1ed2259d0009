"""What a user sees of a public call in ``help()``, an IDE or the API pages: no private names.

A signature names only types and defaults a user can look up: a ``_Private`` return
type (``_LoadResult``) or sentinel default (``_KEEP``) is an implementation detail
leaking into the interface. This is the source-level check; tests/docs/test_site.py
checks the rendered API pages, where the docs extra is installed.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest

#: The modules the API pages document, each with a public ``__all__``.
MODULES = (
    "cudakit",
    "cudakit.amp",
    "cudakit.amp.policy",
    "cudakit.checkpoint",
    "cudakit.data",
    "cudakit.demo",
    "cudakit.device",
    "cudakit.exceptions",
    "cudakit.info",
    "cudakit.memory",
    "cudakit.parallel",
    "cudakit.speed",
    "cudakit.warmup",
)


def _private_names(text: str) -> set[str]:
    """Identifiers a user cannot import: each part that starts with "_" and is no dunder."""
    return {n for n in re.findall(r"(?<!\w)_\w+", text) if not re.fullmatch(r"__\w+__", n)}


def _signature_text(func: Callable[..., Any]) -> str:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return ""
    parts = []
    for p in sig.parameters.values():
        if p.annotation is not p.empty:
            parts.append(str(p.annotation))
        if p.default is not p.empty:
            parts.append(repr(p.default))
    if sig.return_annotation is not sig.empty:
        parts.append(str(sig.return_annotation))
    return " ".join(parts)


def _public_callables(module_name: str) -> Iterator[tuple[str, Callable[..., Any]]]:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if not callable(obj):
            continue
        where = f"{module_name}.{name}"
        yield where, obj
        yield from ((f"{where} (overload)", o) for o in typing.get_overloads(obj))
        if not isinstance(obj, type):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_") and attr != "__init__":
                continue
            func = member.fget if isinstance(member, property) else member
            func = getattr(func, "__func__", func)  # classmethod, staticmethod
            if inspect.isfunction(func):
                yield f"{where}.{attr}", func
                yield from ((f"{where}.{attr} (overload)", o) for o in typing.get_overloads(func))


def test_private_names_finds_what_it_should() -> None:
    assert _private_names("str | _Keep | None _KEEP <cudakit._output.Stderr>") == {
        "_Keep",
        "_KEEP",
        "_output",
    }
    assert not _private_names("Callable[P, R] | WarmedDecorator sys.stderr __init__ 1_000")


@pytest.mark.parametrize("module_name", MODULES)
def test_no_public_signature_names_a_private_type_or_default(module_name: str) -> None:
    bad = [
        f"{where}: {', '.join(sorted(found))}"
        for where, func in _public_callables(module_name)
        if (found := _private_names(_signature_text(func)))
    ]
    assert not bad, "\n".join(bad)
