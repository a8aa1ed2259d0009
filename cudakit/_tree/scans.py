"""The scans prefetch runs around a walk: a flat CPU batch, the CUDA tensors a ``.to()`` made."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .leaves import LEAVES
from .rebuild import attributes, has_attributes

__all__ = [
    "all_on_cpu",
    "device_tensors_in",
]

_Tensor = torch.Tensor


def all_on_cpu(x: Any) -> bool:
    """Whether ``x`` is a tensor, or a flat dict/list/tuple of tensors, all on the CPU.

    The commonest batch that needs nothing (a CPU loop), answered before any walk.
    """
    tp = type(x)
    values: Iterable[Any]
    if tp is tuple or tp is list:
        values = x
    elif tp is dict:
        values = x.values()
    elif tp is _Tensor:
        return bool(x.is_cpu)
    else:
        return False
    for v in values:  # noqa: SIM110 (a plain loop beats all(genexpr) here)
        if type(v) is not _Tensor or not v.is_cpu:
            return False
    return True


def device_tensors_in(obj: Any, out: list[torch.Tensor], seen: set[int] | None = None) -> bool:
    """Append the CUDA tensors inside ``obj``, an object that its own ``.to()`` made.

    The walk cannot see what such a ``.to()`` created, so prefetch searches the result
    (attributes, mappings, sequences; a back-reference is followed once). Returns False
    when tensors may hide where no search reaches (a closure, an object without
    attributes).
    """
    if seen is None:
        seen = set()
    if isinstance(obj, _Tensor):
        if obj.is_cuda:
            out.append(obj)
        return True
    if callable(obj) and not isinstance(obj, type):
        return False  # a function's closure (or a callable object) may hide tensors
    if isinstance(obj, LEAVES) or id(obj) in seen:
        return True
    seen.add(id(obj))
    values: Iterable[Any]
    if isinstance(obj, Mapping):
        values = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        values = obj
    elif not has_attributes(type(obj)):
        return False  # a C object: not searchable
    else:
        values = attributes(obj).values()
    complete = True
    for v in values:
        if not device_tensors_in(v, out, seen):
            complete = False
    return complete
