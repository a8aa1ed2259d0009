"""Old public names kept for one release: a module ``__getattr__`` that warns and answers."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["renamed"]


def renamed(module: str, old_names: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that answers each old name with its new object, and warns.

    >>> import types
    >>> mod = types.ModuleType("demo")
    >>> def new() -> None:
    ...     "The new name."
    >>> mod.__getattr__ = renamed("demo", {"old": new})
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     mod.__getattr__("old") is new
    True
    >>> print(seen[0].message)  # doctest: +NORMALIZE_WHITESPACE
    demo.old is deprecated: it is called demo.new now;
    the old name goes in the next release.
    """

    def __getattr__(name: str) -> Any:
        try:
            new = old_names[name]
        except KeyError:
            raise AttributeError(f"module {module!r} has no attribute {name!r}") from None
        warnings.warn(
            f"{module}.{name} is deprecated: it is called {module}.{new.__name__} now; the old "
            "name goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return new

    return __getattr__
