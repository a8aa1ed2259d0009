"""The values a replay looks at: the first inf/NaN in nested inputs, and copies of a batch.

:func:`~cudakit.amp.locate.find_nonfinite` checks every module's inputs and outputs
with :func:`first_nonfinite`, and replays a step on :func:`copy_batch`'s copies of its
arguments.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["copy_batch", "first_nonfinite"]


def first_nonfinite(
    value: object, path: str, depth: int = 4, masks: bool = False
) -> tuple[str, torch.Tensor] | None:
    """The first tensor holding an inf/NaN in ``value`` (nested containers), with its path.

    ``masks``: a tensor whose only non-finite values are ``-inf`` is fine (an input:
    additive attention masks hold ``-inf``, however they are passed); a NaN or a
    ``+inf`` is not.
    """
    if isinstance(value, torch.Tensor):
        checked = (value.is_floating_point() or value.is_complex()) and value.numel() > 0
        if checked and not value.is_sparse:
            with torch.no_grad():  # records nothing (activation checkpointing counts saves)
                bad = not bool(torch.isfinite(value).all())
                if bad and masks and not value.is_complex():
                    bad = bool(value.isnan().any() or value.isposinf().any())
            if bad:
                return path, value
        return None
    if depth == 0 or isinstance(value, (str, bytes)):
        return None
    items: Iterator[tuple[str, object]]
    if isinstance(value, Mapping):
        items = ((f"{path}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value))
    else:
        return None
    for sub, item in items:
        hit = first_nonfinite(item, sub, depth - 1, masks)
        if hit is not None:
            return hit
    return None


def copy_batch(value: Any, depth: int = 4) -> Any:
    """``value`` with the tensors in its containers cloned, the containers' types kept.

    Lists, tuples and namedtuples, dicts (subclasses too), ``UserDict`` (HF's
    ``BatchEncoding``) and dataclasses are copied shallowly, then given their items'
    copies; anything else is passed as it is.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if depth == 0 or isinstance(value, (str, bytes)):
        return value
    tp = type(value)
    if tp is dict:
        return {k: copy_batch(v, depth - 1) for k, v in value.items()}
    if tp is list or tp is tuple:
        return tp(copy_batch(v, depth - 1) for v in value)
    try:
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return tp._make(copy_batch(v, depth - 1) for v in value)
        # (dict and list subclasses, and UserDict, copy their storage; other mappings
        # may share theirs with the copy, which would change the user's batch.)
        if isinstance(value, (list, dict, UserDict)):
            out: Any = copy.copy(value)
            keys = range(len(value)) if isinstance(value, list) else list(value.keys())
            for key in keys:
                out[key] = copy_batch(value[key], depth - 1)
            return out
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out = copy.copy(value)
            for field in dataclasses.fields(value):
                item = getattr(value, field.name)
                object.__setattr__(out, field.name, copy_batch(item, depth - 1))
            return out
    except Exception:  # a container that refuses to be copied: replayed as it is
        return value
    return value
