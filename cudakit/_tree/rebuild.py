"""Moved containers and objects rebuilt: shallow copies with their new items or attributes.

An object's attributes (``__dict__`` and ``__slots__``) read and set on a copy, cached
properties computed from the old items dropped, and the memoised rebuild whose failure
names the container.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

from .context import Ctx
from .errors import Bad

__all__ = [
    "attributes",
    "cached_properties",
    "copy_attributes",
    "drop_stale",
    "has_attributes",
    "rebuild_failed",
    "rebuilt",
    "set_attributes",
    "shallow_copy",
    "unchanged",
]


def rebuild_failed(x: object, how: str, err: Exception) -> Bad:
    name = type(x).__name__
    return Bad(
        TypeError,
        f"on_device() moved the tensors inside the {name} at {{where}} but cannot rebuild a "
        f"{name} from them: {how} raised {type(err).__name__}: {err}. Give {name} a "
        "`.to(device, non_blocking=False)` method that returns the moved object, or pass a "
        "plain dict/list/tuple instead.",
    )


def rebuilt(x: object, c: Ctx, how: str, build: Callable[[], Any]) -> Any:
    """The moved copy of container ``x`` that ``build()`` makes, memoised.

    A failure becomes a ``TypeError`` that names the container, where it is and ``how``.
    """
    try:
        res = build()
    except Exception as err:
        raise rebuild_failed(x, how, err) from None
    c.memo[id(x)] = res
    return res


def unchanged(x: object, c: Ctx) -> Any:
    c.memo[id(x)] = x
    return x


def cached_properties(tp: type) -> tuple[str, ...]:
    names = _CACHED_PROPERTIES.get(tp)
    if names is None:
        names = _CACHED_PROPERTIES[tp] = tuple(
            name
            for klass in tp.__mro__
            for name, attr in vars(klass).items()
            if isinstance(attr, functools.cached_property)
        )
    return names


_CACHED_PROPERTIES: dict[type, tuple[str, ...]] = {}


def copy_attributes(src: Any, dst: Any) -> None:
    """The instance attributes of ``src`` onto ``dst``, less stale cached properties."""
    state = getattr(src, "__dict__", None)
    if state:
        dst.__dict__.update(state)
        drop_stale(dst)


def drop_stale(res: Any) -> None:
    """Drop values a ``functools.cached_property`` computed from the old items."""
    stale = cached_properties(type(res))
    state = getattr(res, "__dict__", None) if stale else None
    if isinstance(state, dict):
        for name in stale:
            state.pop(name, None)


def shallow_copy(x: Any, assign: Callable[[Any], None]) -> Any:
    # copy.copy keeps instance attributes (and a defaultdict's factory) and does not run
    # __init__ again; `assign` writes the moved items into the copy. Values cached by a
    # functools.cached_property were computed from the old items: the copy drops them,
    # so they are computed again, from the moved items, when first read.
    res = copy.copy(x)
    assign(res)
    drop_stale(res)
    return res


def attributes(x: object) -> dict[str, Any]:
    """An object's instance attributes: its ``__dict__`` and the ``__slots__`` set."""
    found: dict[str, Any] = {}
    state = getattr(x, "__dict__", None)
    if isinstance(state, dict):
        found.update(state)
    for klass in type(x).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in found:
                value = getattr(x, name, _UNSET)
                if value is not _UNSET:  # a slot never set holds nothing
                    found[name] = value
    return found


_UNSET = object()


def set_attributes(x: Any, moved: Mapping[str, Any]) -> Any:
    def assign(res: Any) -> None:
        for name, value in moved.items():
            object.__setattr__(res, name, value)

    return shallow_copy(x, assign)


def has_attributes(tp: type) -> bool:
    """Whether instances of ``tp`` can hold values (a ``__dict__`` or ``__slots__``)."""
    return bool(getattr(tp, "__dictoffset__", 0)) or any(
        klass.__dict__.get("__slots__") for klass in tp.__mro__
    )
