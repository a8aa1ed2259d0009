"""Hypothesis strategies for nested training-loop data, reusable across cudakit's tests.

``nested()`` draws arbitrarily nested containers (dict, OrderedDict, defaultdict,
list, tuple, deque, namedtuple, dataclasses with an ``init=False`` field, frozen
dataclasses, sets) of tensors and plain leaves, with ``st.recursive``; with
``movable=True`` also objects with their own ``.to()`` (:class:`Movable`). The same
strategy serves on_device and prefetch. ``nested_with_pool()`` draws the tensors from a small
pool so that the same tensor object appears in several places (aliasing).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, deque
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

__all__ = [
    "Frozen",
    "Movable",
    "Pair",
    "Record",
    "nested",
    "nested_with_pool",
    "plain_leaves",
    "tensors",
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]


class Pair(NamedTuple):
    """A namedtuple container."""

    first: Any
    second: Any


@dataclasses.dataclass
class Record:
    """A mutable dataclass container, with an ``init=False`` field."""

    value: Any
    extra: Any = None
    note: str = dataclasses.field(init=False, default="note")


@dataclasses.dataclass(frozen=True)
class Frozen:
    """A frozen dataclass container."""

    value: Any


class Movable:
    """An object with its own ``.to()`` (as TensorDict or a custom batch type)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def to(self, device: Any, non_blocking: bool = False) -> Movable:
        return Movable(self.value.to(device, non_blocking=non_blocking))

    def __repr__(self) -> str:
        return f"Movable({self.value!r})"


def tensors(device: str | torch.device = "cpu") -> st.SearchStrategy[torch.Tensor]:
    """Small tensors of several dtypes and shapes (including 0-d and empty)."""
    shapes = st.lists(st.integers(0, 2), min_size=0, max_size=2).map(tuple)

    def make(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(shape, generator=g) * 10
        return t.to(dtype).to(device)

    return st.builds(make, shapes, st.sampled_from(DTYPES), st.integers(0, 2**16))


def plain_leaves() -> st.SearchStrategy[Any]:
    """Non-tensor leaves that must come back as the very same objects."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False),
        st.text(max_size=5),
        st.binary(max_size=5),
        st.sampled_from([torch.float32, torch.device("cpu"), torch.Size([2, 3])]),
    )


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.one_of(st.text(max_size=4), st.integers(-5, 5))
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.lists(children, max_size=3).map(deque),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
        st.dictionaries(keys, children, max_size=4).map(lambda d: defaultdict(list, d)),
        st.builds(Pair, children, children),
        st.builds(Record, children, children),
        st.builds(Frozen, children),
        st.frozensets(children.filter(_hashable), max_size=3),
    )


def _hashable(x: object) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def nested(
    leaves: st.SearchStrategy[Any] | None = None,
    *,
    max_leaves: int = 12,
    movable: bool = False,
) -> st.SearchStrategy[Any]:
    """Nested containers over ``leaves`` (default: tensors and plain leaves).

    ``movable=True`` adds objects with their own ``.to()`` to the leaves.
    """
    if leaves is None:
        leaves = st.one_of(tensors(), plain_leaves())
    if movable:
        leaves = st.one_of(leaves, st.builds(Movable, tensors()))
    return st.recursive(leaves, _containers, max_leaves=max_leaves)


@st.composite
def nested_with_pool(
    draw: st.DrawFn,
    device: str | torch.device = "cpu",
    *,
    max_leaves: int = 12,
    also_on: str | torch.device | None = None,
) -> tuple[Any, list[torch.Tensor]]:
    """A nested structure whose tensors come from a small pool, so some repeat.

    With ``also_on``, each pool tensor lives on ``device`` or on ``also_on``: a mix of
    tensors that must move and tensors that are already in place.
    """
    made = tensors(device) if also_on is None else st.one_of(tensors(device), tensors(also_on))
    pool = draw(st.lists(made, min_size=1, max_size=4))
    leaves = st.one_of(st.sampled_from(pool), plain_leaves())
    return draw(nested(leaves, max_leaves=max_leaves)), pool
