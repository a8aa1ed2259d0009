"""The replay runs on copies of the batch, whatever container holds it.

A step that changes its batch in place (``x.sub_(1)``, ``batch["x"].mul_(2)``) must
not change the user's batch a second time when ``find_nonfinite`` replays it: the
tensors inside namedtuples, dict subclasses, ``UserDict`` (HF's ``BatchEncoding``),
dataclasses and nested lists are copied, and the containers keep their types.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from cudakit.amp import find_nonfinite

NAN = float("nan")


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    y: torch.Tensor


class Encoding(collections.UserDict):  # type: ignore[type-arg]
    """Like transformers' BatchEncoding: a UserDict with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


class Sub(dict):  # type: ignore[type-arg]
    pass


def _wrap(kind: str, x: torch.Tensor, y: torch.Tensor) -> Any:
    return {
        "namedtuple": lambda: Pair(x, y),
        "dataclass": lambda: Batch(x, y),
        "frozen dataclass": lambda: Frozen(x, y),
        "UserDict": lambda: Encoding(x=x, y=y),
        "dict subclass": lambda: Sub(x=x, y=y),
        "OrderedDict": lambda: collections.OrderedDict(x=x, y=y),
        "defaultdict": lambda: collections.defaultdict(list, x=x, y=y),
        "list in a dict": lambda: {"xy": [x, y]},
    }[kind]()


def _parts(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict) and "xy" in batch:
        return batch["xy"][0], batch["xy"][1]
    if isinstance(batch, (collections.abc.Mapping, collections.UserDict)):
        return batch["x"], batch["y"]
    return batch.x, batch.y


KINDS = [
    "namedtuple",
    "dataclass",
    "frozen dataclass",
    "UserDict",
    "dict subclass",
    "OrderedDict",
    "defaultdict",
    "list in a dict",
]


@given(kind=st.sampled_from(KINDS), shift=st.floats(0.5, 4.0))
def test_a_step_that_changes_its_batch_in_place_changes_it_once(kind: str, shift: float) -> None:
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight[0, 1] = NAN
    seen: list[type] = []

    def step(batch: Any) -> torch.Tensor:
        seen.append(type(batch))
        x, y = _parts(batch)
        x.sub_(shift)  # the step's own in-place change of its batch
        return ((model(x) - y) ** 2).mean()

    x, y = torch.ones(4, 3), torch.zeros(4, 1)
    batch = _wrap(kind, x, y)
    step(batch)  # the original call: x is now 1 - shift
    before = x.clone()
    found = find_nonfinite(step, batch)
    assert found is not None
    assert (found.phase, found.name) == ("forward", "")
    assert torch.equal(x, before)  # the replay changed a copy
    assert torch.equal(y, torch.zeros(4, 1))
    assert seen == [type(batch), type(batch)]  # the container kept its type


class Store(collections.abc.MutableMapping):  # type: ignore[type-arg]
    """A mapping over a dict attribute, with no __copy__: a shallow copy shares it."""

    def __init__(self, **items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __delitem__(self, key: str) -> None:
        del self._items[key]

    def __iter__(self) -> Any:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_a_mapping_that_would_share_its_storage_is_left_as_it_is() -> None:
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight[0, 1] = NAN
    x = torch.ones(4, 3)
    batch = Store(x=x)
    found = find_nonfinite(lambda b: model(b["x"]).sum(), batch)
    assert found is not None
    assert batch["x"] is x  # the user's mapping still holds the user's tensor
