"""example_batch refuses values that iterate, but not into batches: a path, a tensor or an
array, a dict (of loaders, or a batch itself). Each used to hand back something that is
not a batch (``'d'``, the first row, a key); now each is a ``TypeError`` that says what
is expected (a DataLoader or an iterable of batches) and the fix, and changes nothing."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from cudakit.warmup import example_batch

EXPECTED = (
    r"(?s)example_batch\(loader=\.\.\.\) expects a DataLoader or an iterable of batches \(a list "
    r"of batches, say\), got "
)


def _loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, shuffle=True)


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("data/train", r"str 'data/train'"),
        (b"data/train", r"bytes b'data/train'"),
        (pathlib.Path("data/train"), r"PosixPath|WindowsPath"),
    ],
    ids=["str", "bytes", "pathlib"],
)
def test_a_path_is_refused_with_the_fix(path: Any, shown: str) -> None:
    with pytest.raises(
        TypeError,
        match=EXPECTED + rf"(?:{shown}).*\. A path is not a loader: build a Dataset that reads "
        r"the files there and pass DataLoader\(dataset, batch_size=\.\.\.\)\.",
    ):
        example_batch(path)


def test_a_tensor_is_refused_instead_of_giving_its_first_row() -> None:
    x = torch.arange(12.0).reshape(4, 3)
    before = torch.get_rng_state()
    with pytest.raises(
        TypeError,
        match=EXPECTED + r"Tensor tensor\(.*\. A tensor is one batch, not a loader \(iterating "
        r"it gives its first row\): use it as the example batch as it is, or pass "
        r"DataLoader\(TensorDataset\(x\), batch_size=\.\.\.\) to take a batch of its rows\.",
    ):
        example_batch(x)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_numpy_array_is_refused_like_a_tensor() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=EXPECTED + r"ndarray .*A numpy array is one batch"):
        example_batch(np.ones((4, 3)))


def test_a_dict_of_loaders_is_refused_instead_of_giving_a_key() -> None:
    g = torch.Generator().manual_seed(1)
    train = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, shuffle=True, generator=g)
    state = g.get_state()
    py = random.getstate()
    with pytest.raises(
        TypeError,
        match=EXPECTED + r"dict \{'train': .*\. Iterating a dict gives its keys, not batches: "
        r"pass one of its loaders, e\.g\. example_batch\(loaders\['train'\]\), or, if it is "
        r"a batch already, use it as the example batch as it is\.",
    ):
        example_batch({"train": train, "val": _loader()})
    assert torch.equal(g.get_state(), state)  # the loader inside was not touched
    assert random.getstate() == py


def test_a_batch_dict_is_refused_with_the_same_fix() -> None:
    with pytest.raises(TypeError, match=EXPECTED + r"dict \{'x': tensor.*gives its keys"):
        example_batch({"x": torch.ones(2)})


@pytest.mark.parametrize(
    "loader",
    [
        [(torch.ones(2),), (torch.zeros(2),)],
        ((torch.ones(2),),),
        [{"x": torch.ones(2)}],
    ],
    ids=["list-of-batches", "tuple-of-batches", "list-of-dicts"],
)
def test_iterables_of_batches_are_still_taken(loader: Any) -> None:
    assert example_batch(loader) is next(iter(loader))
