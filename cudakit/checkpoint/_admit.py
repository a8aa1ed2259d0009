"""What a save may write: values the safe loaders take back, checked before a
checkpoint becomes visible.

A value :mod:`~cudakit.checkpoint._safe_load` would refuse at resume is refused at
``save()`` instead, naming it: the rank file is read back with torch's safe loader
unless :func:`known_to_load` can tell from its types alone that it loads, and each
value DCP pickles is loaded back safely.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ._safe_load import Unloadable, allowed_globals, pickle_of, pickle_of_bytes, refusal_reason

__all__ = ["check_saved", "known_to_load", "refused_in"]


_PLAIN = (
    torch.Tensor,
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
)


def _loads_safely(value: Any, safe_globals: Sequence[Any]) -> list[str]:
    """The globals that keep ``value`` from a safe load (empty: it loads)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    try:
        with allowed_globals(safe_globals):
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except pickle.UnpicklingError as exc:
        with allowed_globals(safe_globals):
            return refusal_reason(exc, pickle_of_bytes(buffer))
    return []


def _leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The values of a state dict that DCP pickles (not tensors), with their names."""
    if isinstance(tree, _PLAIN):
        return
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}.{i}")
    else:
        yield path, tree


_EXACT = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
_CONTAINERS = frozenset({dict, list, tuple})


def _plain_tensor(value: torch.Tensor) -> bool:
    return (
        value.layout == torch.strided
        and value.device.type in ("cpu", "cuda")
        and not value.is_quantized
        and not value.is_conj()
        and not value.is_neg()
        and not value.__dict__
    )


def known_to_load(tree: Any) -> bool:
    """Whether the safe loader surely takes ``tree`` back: builtin dicts, lists and tuples
    of numbers, strings, bytes, None, dtypes, devices and plain tensors, each of exactly
    its type (a subclass, a list or dict met twice, anything else: False, and the pickle
    is loaded back to know).

    >>> known_to_load({"step": 3, "rng": [torch.zeros(2), (1, 2.0)]})
    True
    >>> import collections
    >>> known_to_load({"d": collections.OrderedDict()})
    False
    """
    seen: set[int] = set()
    stack = [tree]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind in _EXACT:
            continue
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if not _plain_tensor(value):
                return False
            continue
        if kind not in _CONTAINERS:
            return False
        if id(value) in seen:
            if kind is tuple:  # (the empty tuple, a tuple shared: walked once)
                continue
            return False  # a list or dict twice, maybe a cycle
        seen.add(id(value))
        if kind is dict:
            stack.extend(value.keys())
            stack.extend(value.values())
        else:
            stack.extend(value)
    return True


def check_saved(
    host_file: Path, host: Any, tensors: Mapping[str, Any], safe_globals: Sequence[Any]
) -> None:
    """Check that what a save wrote loads with the safe loaders: the rank file just
    written (``host``, its state: read back memory-mapped unless :func:`known_to_load`
    says it loads), and the values of the DCP part that DCP pickles.

    Raises:
        Unloadable: naming the refused globals, and the DCP value where it is one.
    """
    try:
        if not known_to_load(host):
            with allowed_globals(safe_globals):
                torch.load(host_file, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        with allowed_globals(safe_globals):
            refused = refusal_reason(exc, pickle_of(host_file))
        raise Unloadable(f"the rank file holds {', '.join(refused)}") from None
    for name, value in _leaves(tensors, ""):
        refused = _loads_safely(value, safe_globals)
        if refused:
            raise Unloadable(
                f"the model or optimizer state {name!r} ({type(value).__name__}) holds "
                f"{', '.join(refused)}"
            )


def refused_in(value: Any, safe_globals: Sequence[Any]) -> list[str]:
    """The globals that keep ``value`` from a safe load (empty: it loads); for messages."""
    return _loads_safely(value, safe_globals)
