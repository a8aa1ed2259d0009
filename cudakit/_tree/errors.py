"""The errors of a walk: a bad input found on the way, named by its path in the input.

:class:`Bad` collects the path (``obj['a'][1]``) while the walk unwinds, :class:`Cycle`
is a container reached again inside itself (the memo's ``BUSY`` marker, set by
:func:`busy_or_done`), and :func:`user_error` turns either into the user-facing error.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from .context import Ctx

__all__ = [
    "BUSY",
    "Bad",
    "Cycle",
    "busy_or_done",
    "located",
    "meta_copy_error",
    "user_error",
]

BUSY = object()  # memo marker: this container is being traversed right now (cycle guard)


class Bad(Exception):
    """Internal: bad input found during traversal; collects the path while unwinding."""

    def __init__(self, exc_type: type[Exception], message: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message
        self.path: list[str] = []  # innermost first
        self.cause: BaseException | None = None  # chained to the user-facing error

    def add(self, step: str, container_id: int) -> None:
        self.path.append(step)

    def where(self, root: str) -> str:
        return root + "".join(reversed(self.path))

    def render(self, root: str) -> str:
        return self.message.replace("{where}", self.where(root))


def meta_copy_error(err: Exception, c: Ctx) -> Bad:
    """The user-facing error for copying a meta tensor; any other error is re-raised."""
    if not isinstance(err, NotImplementedError) or "meta tensor" not in str(err):
        raise err
    bad = Bad(
        ValueError,
        f"on_device() cannot copy the tensor at {{where}} from the meta device to {c.device}: "
        "meta tensors have a shape but no data. Create it on the target device instead "
        "(e.g. `torch.empty_like(t, device=...)`), or for a module use "
        "`module.to_empty(device=...)` and then initialise or load its weights.",
    )
    bad.cause = err
    return bad


def user_error(e: Exception, c: Ctx, root: str) -> NoReturn:
    """Raise the user-facing error for an internal one (:class:`Bad`, a meta copy, a
    recursion); called inside the ``except`` clause that caught it."""
    if isinstance(e, RecursionError):
        raise ValueError(
            f"on_device() cannot walk {root}: it is nested deeper than Python's recursion "
            f"limit ({sys.getrecursionlimit()}) allows. Flatten the structure, or raise the "
            "limit with sys.setrecursionlimit(...)."
        ) from None
    bad = e if isinstance(e, Bad) else meta_copy_error(e, c)
    raise bad.exc_type(bad.render(root)) from bad.cause


def located(err: Exception, step: str, container_id: int, c: Ctx) -> Bad:
    """``err``, raised inside a container, as a :class:`Bad` with ``step`` added to its path."""
    bad = err if isinstance(err, Bad) else meta_copy_error(err, c)
    bad.add(step, container_id)
    return bad


class Cycle(Bad):
    """Internal: a container was reached again while it was still being traversed."""

    def __init__(self, container: object) -> None:
        super().__init__(ValueError, "")
        self.container_id = id(container)
        self.kind = type(container).__name__
        self.depth: int | None = None  # len(path) once the repeated container added its step

    def add(self, step: str, container_id: int) -> None:
        self.path.append(step)
        if self.depth is None and container_id == self.container_id:
            self.depth = len(self.path)

    def render(self, root: str) -> str:
        steps = list(reversed(self.path))
        head = root + "".join(steps[: len(steps) - (self.depth or 0)])
        return (
            f"on_device() found a reference cycle: {self.where(root)} refers back to {head} "
            f"(a {self.kind} that contains itself), which cannot be copied. Break the cycle "
            "(e.g. store an index or key instead of the container), or move the tensors "
            "inside it yourself."
        )


def busy_or_done(x: object, c: Ctx) -> Any:
    hit = c.memo.get(id(x))
    if hit is None:
        c.memo[id(x)] = BUSY
        return BUSY
    if hit is BUSY:
        raise Cycle(x)
    return hit
