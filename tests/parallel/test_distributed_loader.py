"""distributed_loader on one process: a DataLoader whose DistributedSampler reshuffles
every epoch (in persistent workers too), shards without repeats under ``drop_last``,
and takes numpy integers as ints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher_env import clean_launcher_env  # noqa: F401 (autouse fixture)
from torch.utils.data import DataLoader, TensorDataset

import cudakit.parallel as cp


def test_distributed_loader_is_a_dataloader() -> None:
    data = TensorDataset(torch.arange(6))
    loader = cp.distributed_loader(data, batch_size=2, shuffle=False, num_workers=0)
    assert isinstance(loader, DataLoader)
    assert isinstance(loader, cp.DistributedLoader)
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    assert (loader.batch_size, loader.num_workers, loader.drop_last) == (2, 0, False)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert loader.epoch == 1
    with pytest.raises(TypeError, match=r"set_epoch\(epoch=\.\.\.\) expects an int >= 0, got str"):
        loader.set_epoch("1")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"set_epoch\(epoch=\.\.\.\) expects an int >= 0, got int -2"
    ):
        loader.set_epoch(-2)
    assert loader.epoch == 1
    assert len(cp.distributed_loader(data, batch_size=None)) == 6  # single samples


def test_distributed_loader_persistent_workers_reshuffle() -> None:
    data = TensorDataset(torch.arange(16))
    loader = cp.distributed_loader(
        data,
        batch_size=16,
        seed=1,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="spawn",  # no fork of a process whose threads earlier tests left
    )
    first = next(iter(loader))[0].tolist()
    second = next(iter(loader))[0].tolist()
    assert sorted(first) == sorted(second) == list(range(16))
    assert first != second  # set_epoch reached the sampler the worker iterates


def _shards(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> list[list[int]]:
    data = torch.utils.data.TensorDataset(torch.arange(11))
    shards = []
    for r in range(2):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(r))
        loader = cp.distributed_loader(data, batch_size=2, shuffle=True, seed=3, **kwargs)
        loader.sampler.set_epoch(0)  # type: ignore[attr-defined]
        shards.append([int(i) for (batch,) in loader for i in batch])
    return shards


def test_drop_last_repeats_no_sample_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _shards(monkeypatch, drop_last=True)
    assert len(a) == len(b) == 4  # 5 each without repeats, then the last half batch dropped
    assert not set(a) & set(b)
    a, b = _shards(monkeypatch)  # drop_last=False: padded with repeats, nothing dropped
    assert len(a) == len(b) == 6
    assert set(a) | set(b) == set(range(11))


def test_numpy_integers_reach_the_loader_as_ints(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    data = torch.utils.data.TensorDataset(torch.arange(8))
    loader = cp.distributed_loader(
        data, batch_size=np.int64(4), seed=np.int64(3), num_workers=np.int64(0)
    )
    assert type(loader.batch_size) is int
    assert type(loader.num_workers) is int
    assert [len(b) for (b,) in loader] == [4, 4]
    from cudakit import loader_kwargs

    kw = loader_kwargs("cpu", num_workers=np.int64(1))
    assert type(kw["num_workers"]) is int
    assert type(kw["persistent_workers"]) is bool
