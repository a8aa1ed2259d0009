"""Teach :func:`~cudakit.device.on_device` (and :func:`~cudakit.data.prefetch`) a container type."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from .._check import check_callable, check_optional, check_type, fail_value
from .._tree import register

__all__ = ["register_container"]

C = TypeVar("C", bound=type)

_BUILTIN = (dict, list, tuple, set, frozenset, str, bytes, int, float, complex, bool)
#: Containers whose subclasses (namedtuples too) the walker already walks item by item.
_WALKED = (dict, list, tuple, set, frozenset, collections.deque)


def register_container(
    cls: C,
    *,
    flatten: Callable[[Any], Mapping[Any, Any]] | None = None,
    unflatten: Callable[[Any, dict[Any, Any]], Any] | None = None,
) -> C:
    """Register a class whose instances hold tensors, so that they are moved too.

    After registration, :func:`~cudakit.device.on_device` and
    :func:`~cudakit.data.prefetch` walk instances of ``cls`` (and of its subclasses)
    like any built-in container: tensors inside are moved, a tensor found twice is
    moved once, the caller's object is left unchanged, and an error names the path
    (``obj['sample'].pixels``). Registration takes precedence over the object's own
    ``.to()``. Returns ``cls``, so it also works as a class decorator.

    By default the instance attributes (``__dict__`` and ``__slots__``) are moved and
    set on a shallow copy (``copy.copy``), which suits most plain classes. Pass
    ``flatten`` and ``unflatten`` for a class that must be taken apart or rebuilt
    another way.

    ``unflatten`` must return the new object: ``None`` is a ``TypeError`` from
    ``on_device``. Under the default ``unflatten``, which sets each key as an
    attribute, ``flatten``'s keys must be attribute names: a key that is no attribute
    of the object (``{"pixel": s.pixels}``) is a ``ValueError`` from ``on_device``
    before anything moves (registration has no instance to check it on). A
    ``flatten`` of your own that misses an attribute holding tensors away from the
    target (a typo, a forgotten key) leaves them behind with a
    :class:`~cudakit.exceptions.TensorsLeftBehindWarning` that names the attributes,
    once per type.

    >>> import torch
    >>> import cudakit
    >>> class Sample:
    ...     def __init__(self, pixels, label):
    ...         self.pixels, self.label = pixels, label
    >>> cudakit.register_container(Sample)
    <class 'cudakit.device.register.Sample'>
    >>> moved = cudakit.on_device(Sample(torch.ones(2), "cat"), device="meta")
    >>> moved.pixels.device, moved.label
    (device(type='meta'), 'cat')

    Args:
        cls: The class to register.
        flatten: ``flatten(obj)`` returns a dict of the values to move, e.g.
            ``lambda s: {"pixels": s.pixels}``. Default: the instance attributes.
        unflatten: ``unflatten(obj, moved)`` returns the new object from the original
            and the dict of moved values (same keys as ``flatten``'s). Default: a
            shallow copy of ``obj`` with ``moved`` set as attributes.

    Returns:
        ``cls``.

    Raises:
        TypeError: ``cls`` is not a class, or ``flatten``/``unflatten`` is not callable.
        ValueError: ``cls`` is a tensor, module, optimizer or built-in container type,
            which cudakit already handles, ``object`` or ``NoneType``; or a subclass of a
            built-in container (a namedtuple, say) without ``flatten`` and ``unflatten``
            (the default would move its attributes and leave its items behind).

    .. versionadded:: 0.1
    """
    fn = "register_container"
    check_type(
        fn,
        "cls",
        cls,
        type,
        expected="a class",
        fix="Pass the class itself, e.g. register_container(MyBatch), not an instance.",
    )
    for arg, value in (("flatten", flatten), ("unflatten", unflatten)):
        check_optional(
            check_callable,
            fn,
            arg,
            value,
            expected="a function or None",
            fix=f"Pass {arg}=lambda obj: ... or leave it out for the default.",
        )
    if cls in (object, type(None)):
        fail_value(
            fn,
            "cls",
            "a class of your own",
            cls,
            f"Registering {cls.__name__} would make every "
            f"{'class' if cls is object else 'None'} a container. Register only your own "
            "classes.",
        )
    if issubclass(cls, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)) or cls in _BUILTIN:
        fail_value(
            fn,
            "cls",
            "a class of your own",
            cls,
            f"cudakit already moves {cls.__name__} objects; register only your own classes.",
        )
    base = next((b for b in _WALKED if issubclass(cls, b)), None)
    if base is not None and (flatten is None or unflatten is None):
        # The default flatten reads attributes only: the items would be left behind.
        fail_value(
            fn,
            "cls",
            "a class whose items cudakit does not walk already",
            cls,
            f"{cls.__name__} is a {base.__name__} subclass: on_device already walks its items "
            "(keeping its type and attributes). Leave it unregistered, or register it with "
            "flatten= and unflatten= of your own.",
        )
    register(cls, flatten, unflatten)
    return cls
