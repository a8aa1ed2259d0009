"""distributed_loader answers every bad argument when it is called.

Its options, kinds and values, and what used to fail only at the first batch:
a ``collate_fn`` (or ``worker_init_fn``) that is not callable, and a dataset that a
sampler's int indices cannot read (a dict keyed by anything but 0..len-1, a path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from launcher_env import clean_launcher_env  # noqa: F401 (autouse fixture)
from torch.utils.data import Dataset, TensorDataset

import cudakit.parallel as cp


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(6.0))


@pytest.mark.parametrize("arg", ["collate_fn", "worker_init_fn"])
def test_a_loader_function_that_is_not_callable_is_refused_at_the_call(arg: str) -> None:
    with pytest.raises(
        TypeError,
        match=rf"distributed_loader\({arg}=\.\.\.\) expects a function or None, got int 3\. "
        rf"Pass {arg}=my_function \(a def or a lambda\), or leave it out for DataLoader's "
        r"default\.",
    ):
        cp.distributed_loader(_data(), **{arg: 3})


def test_a_callable_collate_fn_and_none_are_taken() -> None:
    loader = cp.distributed_loader(
        _data(), batch_size=3, shuffle=False, collate_fn=lambda items: len(items)
    )
    assert list(loader) == [3, 3]
    assert len(cp.distributed_loader(_data(), collate_fn=None)) == 6


@pytest.mark.parametrize(
    "dataset",
    [
        {"x": torch.ones(4), "y": torch.zeros(4)},  # a dict of columns
        {"a": 1, "b": 2},
        {1: "one", 2: "two"},  # int keys, but not 0..len-1
    ],
    ids=["columns", "str-keys", "int-keys-from-1"],
)
def test_a_dict_not_indexed_by_0_to_len_is_refused(dataset: dict[Any, Any]) -> None:
    with pytest.raises(
        TypeError,
        match=r"distributed_loader\(dataset=\.\.\.\) expects a map-style dataset whose "
        r"__getitem__ takes the int indices 0\.\.len-1 that a sampler draws, got dict .*\. A "
        r"dict is read by its keys: pass list\(d\.values\(\)\) for a dict of samples, or "
        r"TensorDataset\(d\['x'\], d\['y'\]\) for a dict of columns\.",
    ):
        cp.distributed_loader(dataset)


def test_a_dict_keyed_0_to_len_is_a_dataset() -> None:
    loader = cp.distributed_loader({0: "a", 1: "b", 2: "c"}, batch_size=None, shuffle=False)
    assert list(loader) == ["a", "b", "c"]


def test_a_dataset_that_is_also_a_mapping_is_its_own_business() -> None:
    class Keyed(Dataset[int], dict):  # type: ignore[type-arg]
        def __getitem__(self, i: Any) -> int:
            return int(i) * 10

        def __len__(self) -> int:
            return 3

    assert list(cp.distributed_loader(Keyed(), batch_size=None, shuffle=False)) == [0, 10, 20]


@pytest.mark.parametrize("path", ["data/train", b"data/train"], ids=["str", "bytes"])
def test_a_path_is_refused(path: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"distributed_loader\(dataset=\.\.\.\) expects a map-style dataset .*got "
        r"(str|bytes) .*data/train.*\. A path is not a dataset: build a Dataset that reads the "
        r"files there \(its __getitem__\(i\) returns sample i\), and pass that\.",
    ):
        cp.distributed_loader(path)


def _numbers() -> Iterator[int]:
    yield from range(3)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (
            (None,),
            {},
            TypeError,
            r"distributed_loader\(dataset=\.\.\.\) expects a map-style dataset \(with "
            r"__getitem__ and __len__\), got NoneType None\. Pass e\.g\.",
        ),
        (
            (_numbers(),),
            {},
            TypeError,
            r"distributed_loader\(dataset=\.\.\.\) expects a map-style dataset .* got generator "
            r".*materialise it with list\(\.\.\.\)",
        ),
        (
            (iter([1, 2]),),
            {},
            TypeError,
            r"got list_iterator",
        ),
        ((), {"seed": "a"}, TypeError, r"distributed_loader\(seed=\.\.\.\) expects an int"),
        ((), {"seed": 2**64}, ValueError, r"distributed_loader\(seed=\.\.\.\) expects an int"),
        ((), {"seed": 1.0}, TypeError, r"distributed_loader\(seed=\.\.\.\) expects an int"),
        ((), {"shuffle": "no"}, TypeError, r"distributed_loader\(shuffle=\.\.\.\) expects True"),
        ((), {"drop_last": 1}, TypeError, r"distributed_loader\(drop_last=\.\.\.\) expects True"),
        ((), {"batch_size": 0}, ValueError, r"distributed_loader\(batch_size=\.\.\.\) expects"),
        ((), {"batch_size": "8"}, TypeError, r"distributed_loader\(batch_size=\.\.\.\) expects"),
        (
            (),
            {"num_wrokers": 2},
            TypeError,
            r"distributed_loader\(\) got keyword argument\(s\) 'num_wrokers' that DataLoader "
            r"does not accept\. Valid: num_workers",
        ),
        ((), {"batch_sampler": None}, TypeError, r"so batch_sampler= cannot be passed"),
    ],
)
def test_distributed_loader_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    data = TensorDataset(torch.arange(4))
    with pytest.raises(exc, match=match):
        cp.distributed_loader(*(args or (data,)), **kwargs)
    assert torch.equal(data.tensors[0], torch.arange(4))


def test_distributed_loader_checks_option_values() -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    with pytest.raises(ValueError, match=r"distributed_loader\(\): drop_last=True needs"):
        cp.distributed_loader(ds, None, drop_last=True)
    with pytest.raises(ValueError, match=r"distributed_loader\(num_workers=\.\.\.\)"):
        cp.distributed_loader(ds, 2, num_workers=-1)
    with pytest.raises(TypeError, match=r"distributed_loader\(generator=\.\.\.\) expects"):
        cp.distributed_loader(ds, 2, generator="x")


class _Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


def test_distributed_loader_errors() -> None:
    with pytest.raises(TypeError, match=r"map-style dataset .* IterableDataset _Stream"):
        cp.distributed_loader(_Stream())
    data = torch.utils.data.TensorDataset(torch.arange(4))
    with pytest.raises(TypeError, match=r"makes its own DistributedSampler, so sampler="):
        cp.distributed_loader(data, sampler=None)
