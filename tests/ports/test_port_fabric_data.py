"""distributed_loader, prefetch and loader_kwargs against Lightning Fabric's data tests.

Ported from Lightning Fabric tests_fabric/utilities/test_data.py
(test_set_sampler_epoch, test_suggested_max_num_workers,
test_suggested_max_num_workers_not_triggering_torch_warning) and
tests_fabric/test_fabric.py (test_setup_dataloaders_distributed_sampler_parity,
test_setup_dataloaders_distributed_sampler_shuffle). Ranks are simulated with torchrun's
variables.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from launcher_env import clean_launcher_env, torchrun_env  # noqa: F401 (autouse fixture)
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import cudakit.parallel as cp
from cudakit.data import loader_kwargs, prefetch
from cudakit.data.loaders import _choose_loader_kwargs


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    for k, v in torchrun_env(world, rank).items():
        monkeypatch.setenv(k, v)


def test_prefetch_set_epoch_reaches_samplers() -> None:
    ds = TensorDataset(torch.arange(8))
    sampler = DistributedSampler(ds, num_replicas=2, rank=0)
    prefetch(DataLoader(ds, sampler=sampler, batch_size=2), device="cpu").set_epoch(55)
    assert sampler.epoch == 55

    # A DistributedSampler inside a BatchSampler (the loader's .sampler is a SequentialSampler).
    inner = DistributedSampler(ds, num_replicas=2, rank=0)
    loader = DataLoader(ds, batch_sampler=BatchSampler(inner, 2, False))
    prefetch(loader, device="cpu").set_epoch(7)
    assert inner.epoch == 7

    prefetch([torch.ones(1)], device="cpu").set_epoch(3)  # no sampler: nothing happens


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_distributed_sampler_parity(
    monkeypatch: pytest.MonkeyPatch, shuffle: bool, batch_size: int
) -> None:
    as_rank(monkeypatch, 0, 2)
    assert (cp.rank(), cp.world_size()) == (0, 2)
    dataset = torch.arange(10)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=shuffle)
    torch_loader = DataLoader(dataset, sampler=sampler, batch_size=batch_size)
    loader = cp.distributed_loader(dataset, batch_size=batch_size, shuffle=shuffle)

    def fetch_epoch(loader: DataLoader[torch.Tensor]) -> torch.Tensor:
        it = iter(loader)
        return torch.cat((next(it), next(it)))

    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert torch.equal(fetch_epoch(torch_loader), fetch_epoch(loader))
    assert loader.sampler.epoch == 1


def test_distributed_loader_no_shuffle_strides_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = TensorDataset(torch.arange(8))
    for rank, expected in [(0, [0, 2, 4, 6]), (1, [1, 3, 5, 7])]:
        as_rank(monkeypatch, rank, 2)
        assert [t[0].item() for t in cp.distributed_loader(ds, shuffle=False)] == expected


@pytest.mark.parametrize(
    ("cpus", "local_world_size", "expected"),
    [(1, 1, 0), (2, 1, 1), (2, 2, 0), (4, 2, 1), (4, 1, 3), (64, 1, 8), (64, 8, 7), (3, 2, 0)],
)
def test_suggested_max_num_workers(cpus: int, local_world_size: int, expected: int) -> None:
    kw = _choose_loader_kwargs("cuda", cpus, local_world_size)
    assert kw["num_workers"] == expected
    assert kw["persistent_workers"] == (expected > 0)
    assert kw["pin_memory"] is True


@pytest.mark.parametrize("cpus", [1, 2, 3])
@pytest.mark.parametrize("local_world_size", [1, 2, 3])
def test_suggested_max_num_workers_not_triggering_torch_warning(
    monkeypatch: pytest.MonkeyPatch, cpus: int, local_world_size: int
) -> None:
    monkeypatch.delattr(torch.utils.data.dataloader.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(torch.utils.data.dataloader.os, "cpu_count", lambda: cpus)
    n = _choose_loader_kwargs("cuda", cpus, local_world_size)["num_workers"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataLoader(range(2), num_workers=n)


def test_cpu_loader_kwargs_and_overrides() -> None:
    off = {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    assert loader_kwargs("cpu") == off
    assert loader_kwargs("cpu", num_workers=2) == {
        **off,
        "num_workers": 2,
        "persistent_workers": True,
    }
    with pytest.raises(ValueError, match="only speeds up copies to a CUDA device"):
        loader_kwargs("cpu", pin_memory=True)
