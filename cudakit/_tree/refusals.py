"""The refusals of a walk: loaders and iterators make batches, they do not hold them."""

from __future__ import annotations

import types
from typing import Any, NoReturn

from .context import Ctx
from .errors import Bad

__all__ = [
    "reject_iterator",
    "reject_loader",
]

_PREFETCH_HINT = (
    "Move each batch inside the loop (`for batch in loader: batch = on_device(batch)`), or "
    "wrap the loader with `cudakit.data.prefetch(loader)`, which yields batches already on "
    "the device and overlaps the copies with compute."
)


def reject_loader(x: Any, c: Ctx) -> NoReturn:
    raise Bad(
        TypeError,
        f"on_device() cannot move a {type(x).__name__} (found at {{where}}): a loader makes "
        f"batches, it does not hold them. {_PREFETCH_HINT}",
    )


def reject_iterator(x: Any, c: Ctx) -> NoReturn:
    kind = (
        "a generator" if isinstance(x, types.GeneratorType) else f"an iterator ({type(x).__name__})"
    )
    raise Bad(
        TypeError,
        f"on_device() cannot move {kind} (found at {{where}}): its items are produced "
        f"lazily and moving them would consume it. {_PREFETCH_HINT}",
    )
