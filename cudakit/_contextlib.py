"""One object that works as ``with x:`` and as ``@x``.

Modelled on ``torch/utils/_contextlib.py`` but with one difference that matters:
a decorated function enters a *fresh clone* of the object on every call, so
recursion and threads never share the saved state of an outer call (the bug
``torch.autocast`` has when one instance is reused).
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeVar, cast

from typing_extensions import ParamSpec

from ._check import check_callable

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["ContextDecorator", "reject_deferred_body"]


def reject_deferred_body(func: Callable[..., Any], what: str, fix: str, why: str = "") -> None:
    """Raise ``TypeError`` for a generator or coroutine function, whose body runs late.

    A wrapper that sets something up around a call cannot cover such a body: it runs
    when the result is iterated or awaited, after the wrapper has finished.
    """
    if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
        raise TypeError(
            f"{what} the generator or coroutine function "
            f"{getattr(func, '__qualname__', func)!r}: its body runs after the call returns"
            f"{why}. {fix}"
        )


class ContextDecorator(ABC):
    """Base for cudakit's context managers that double as decorators.

    Subclasses implement ``__enter__``/``__exit__`` and :meth:`clone`, which
    returns a new, un-entered object with the same configuration. Used as a
    decorator, the object itself is never entered: each call enters a clone.
    """

    @abstractmethod
    def clone(self) -> Self:
        """Return a fresh, un-entered copy with the same configuration."""

    @abstractmethod
    def __enter__(self) -> Any: ...

    @abstractmethod
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Decorate ``func`` so that every call runs inside a fresh clone."""
        check_callable(
            type(self).__name__,
            "func",
            func,
            expected="a function to decorate",
            fix=f"Use it as `@{type(self).__name__.lower()}(...)` above a `def`, or as "
            "`with ...:` around a block.",
        )
        reject_deferred_body(
            func,
            f"{type(self).__name__} cannot decorate",
            "Use `with` inside the function body instead.",
        )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.clone():
                return func(*args, **kwargs)

        return cast(Callable[P, R], wrapper)
