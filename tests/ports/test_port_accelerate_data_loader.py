"""distributed_loader and prefetch against accelerate's data loader tests.

Ported from Hugging Face accelerate tests/test_data_loader.py: shards per process
(test_batch_sampler_shards_with_no_splits, drop_last), test_reproducibility,
test_set_epoch_in_batch_sampler, test_dataloader_inheritance,
test_iterable_dataset_with_non_tensor_samples (map-style), and the DataLoaderShard
tests (device placement, length, iterating twice, test_end_of_dataloader,
test_ensure_dataloader_gets_cleaned_up) on cudakit.data.prefetch's CPU/meta path.
Ranks are simulated with torchrun's variables; test_port_accelerate_distributed.py
runs two real ones.
"""

from __future__ import annotations

import gc
import weakref
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from launcher_env import clean_launcher_env, torchrun_env  # noqa: F401 (autouse fixture)
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import cudakit.parallel as cp
from cudakit.data import prefetch

FOUR_BATCHES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def shards(
    monkeypatch: pytest.MonkeyPatch, n: int, batch_size: int, **kwargs: Any
) -> list[tuple[int, list[list[int]]]]:
    """(len, batches) of each of 2 ranks' distributed_loader over range(n)."""
    out = []
    for rank in range(2):
        for k, v in torchrun_env(2, rank).items():
            monkeypatch.setenv(k, v)
        loader = cp.distributed_loader(list(range(n)), batch_size=batch_size, **kwargs)
        assert (loader.sampler.rank, loader.sampler.num_replicas) == (rank, 2)
        out.append((len(loader), [b.tolist() for b in loader]))
    return out


def _epoch(loader: Any) -> list[Any]:
    return [b.tolist() for b in loader]


@pytest.mark.parametrize("n", [24, 21, 22, 20, 2])
def test_shards_even_batches_no_drop(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    res = shards(monkeypatch, n, 3, shuffle=False)
    lens = [len(batches) for _, batches in res]
    assert lens[0] == lens[1], "every rank must get the same number of batches"
    assert [length for length, _ in res] == lens  # __len__ agrees with iteration
    assert {x for _, batches in res for b in batches for x in b} == set(range(n))
    per_rank = [sum(len(b) for b in batches) for _, batches in res]
    assert per_rank == [-(-n // 2)] * 2  # padded with repeats


@pytest.mark.parametrize("n", [24, 21, 22, 20, 2])
def test_shards_drop_last(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    res = shards(monkeypatch, n, 3, shuffle=False, drop_last=True)
    lens = [len(batches) for _, batches in res]
    assert lens == [(n // 2) // 3] * 2
    assert [length for length, _ in res] == lens
    flat = [x for _, batches in res for b in batches for x in b]
    assert len(flat) == len(set(flat)), "drop_last: nothing repeated"
    assert all(len(b) == 3 for _, batches in res for b in batches)


def test_shards_disjoint_when_divisible(monkeypatch: pytest.MonkeyPatch) -> None:
    (_, first), (_, second) = shards(monkeypatch, 24, 3, shuffle=True, seed=5)
    a = {x for b in first for x in b}
    b = {x for batch in second for x in batch}
    assert not a & b
    assert a | b == set(range(24))


def test_reproducibility() -> None:
    def order(seed: int) -> list[Any]:
        return _epoch(cp.distributed_loader(list(range(6)), batch_size=1, seed=seed))

    assert order(21) == order(21)
    assert order(21) != order(42)


def test_global_rng_does_not_change_order() -> None:
    torch.manual_seed(0)
    a = _epoch(cp.distributed_loader(list(range(16)), batch_size=1, seed=3))
    torch.manual_seed(1)
    b = _epoch(cp.distributed_loader(list(range(16)), batch_size=1, seed=3))
    assert a == b


def test_set_epoch_automatic_and_resumable() -> None:
    loader = cp.distributed_loader(list(range(32)), batch_size=4, seed=0)
    e0, e1 = _epoch(loader), _epoch(loader)
    assert e0 != e1
    assert (loader.epoch, loader.sampler.epoch) == (2, 1)
    loader.set_epoch(1)
    assert _epoch(loader) == e1


def test_set_epoch_with_persistent_workers() -> None:
    loader = cp.distributed_loader(
        list(range(32)), batch_size=4, seed=0, num_workers=1, persistent_workers=True
    )
    fresh = cp.distributed_loader(list(range(32)), batch_size=4, seed=0)
    e0, e1 = _epoch(loader), _epoch(loader)
    assert e0 != e1
    assert (e0, e1) == (_epoch(fresh), _epoch(fresh))


def test_dataloader_inheritance() -> None:
    loader = cp.distributed_loader(TensorDataset(torch.arange(16.0)), batch_size=4)
    assert isinstance(loader, DataLoader)
    assert (loader.batch_size, len(loader)) == (4, 4)


def test_no_shuffle_single_process_in_order() -> None:
    assert _epoch(cp.distributed_loader(list(range(16)), batch_size=4, shuffle=False)) == (
        FOUR_BATCHES
    )


def test_batch_size_none_yields_samples() -> None:
    loader = cp.distributed_loader(list(range(4)), batch_size=None, shuffle=False)
    assert [int(v) for v in loader] == [0, 1, 2, 3]


def test_iterable_dataset_refused() -> None:
    """accelerate shards an IterableDataset; cudakit refuses it (documented)."""

    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

    with pytest.raises(TypeError, match="needs a map-style dataset"):
        cp.distributed_loader(Stream())


def test_non_tensor_samples() -> None:
    data = [{"tensor": torch.ones(2), "non_tensor": "v"} for _ in range(4)]
    for b in cp.distributed_loader(data, batch_size=2):
        assert isinstance(b["tensor"], torch.Tensor)
        assert b["non_tensor"] == ["v", "v"]


# ----------------------------------------------------------------- prefetch (DataLoaderShard)


def test_prefetch_moves_batches_and_has_len() -> None:
    ds = TensorDataset(torch.arange(16.0).view(16, 1), torch.arange(16))
    batches = prefetch(DataLoader(ds, batch_size=4), device="meta")
    out = list(batches)
    assert len(out) == len(batches) == 4
    assert all(x.device.type == "meta" and y.device.type == "meta" for x, y in out)


def test_prefetch_end_of_dataloader_twice() -> None:
    batches = prefetch(DataLoader(list(range(16)), batch_size=4), device="cpu")
    assert _epoch(batches) == _epoch(batches) == FOUR_BATCHES


def test_prefetch_generator_has_no_len() -> None:
    def gen() -> Iterator[dict[str, torch.Tensor]]:
        for i in range(3):
            yield {"x": torch.ones(2) * i}

    batches = prefetch(gen(), device="cpu")
    with pytest.raises(TypeError, match="has no len"):
        len(batches)  # type: ignore[arg-type]
    assert [b["x"][0].item() for b in batches] == [0, 1, 2]


def test_prefetch_loader_gets_cleaned_up() -> None:
    class Holder:
        def __init__(self) -> None:
            self.loader = DataLoader(list(range(16)), batch_size=4)
            self.iter = iter(prefetch(self.loader, device="cpu"))

    holder = Holder()
    assert next(holder.iter).tolist() == [0, 1, 2, 3]
    ref = weakref.ref(holder.loader)
    del holder
    gc.collect()
    assert ref() is None


def test_prefetch_break_closes_source_iterator() -> None:
    closed = []

    class Source:
        def __iter__(self) -> Iterator[torch.Tensor]:
            try:
                for i in range(10):
                    yield torch.ones(1) * i
            finally:
                closed.append(True)

    for _ in prefetch(Source(), device="cpu"):
        break
    assert closed == [True]


def test_prefetch_break_leaves_passed_iterator_resumable() -> None:
    """Documented: an iterator you pass in is released, not closed."""

    def gen() -> Iterator[torch.Tensor]:
        for i in range(4):
            yield torch.ones(1) * i

    g = gen()
    for _ in prefetch(g, device="cpu"):
        break
    assert next(g).item() == 1.0  # on the CPU there is no look-ahead


def test_prefetch_error_after_earlier_batches() -> None:
    def gen() -> Iterator[torch.Tensor]:
        yield torch.ones(1)
        raise ValueError("bad batch")

    seen = []

    def consume() -> None:
        for b in prefetch(gen(), device="cpu"):
            seen.append(b)

    with pytest.raises(ValueError, match="bad batch"):
        consume()
    assert len(seen) == 1


def test_prefetch_set_epoch_reaches_batch_sampler() -> None:
    class EpochBatchSampler(BatchSampler):
        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    ds = list(range(16))
    sampler = EpochBatchSampler(SequentialSampler(ds), batch_size=4, drop_last=False)
    prefetch(DataLoader(ds, batch_sampler=sampler), device="cpu").set_epoch(1)
    assert sampler.epoch == 1


def test_prefetch_set_epoch_reaches_distributed_loader() -> None:
    batches = prefetch(cp.distributed_loader(list(range(16)), batch_size=4, seed=0), device="cpu")
    assert len(batches) == 4
    e0, e1 = _epoch(batches), _epoch(batches)
    assert e0 != e1
    batches.set_epoch(0)
    assert _epoch(batches) == e0


def test_prefetch_nested_batches_keep_types() -> None:
    Pair = namedtuple("Pair", "a b")
    data = [Pair(torch.ones(2), {"k": [torch.zeros(1), "s"]}) for _ in range(3)]
    for b in prefetch(data, device="meta"):
        assert isinstance(b, Pair)
        assert b.a.device.type == "meta"
        assert b.b["k"][0].device.type == "meta"
        assert b.b["k"][1] == "s"


def test_prefetch_keeps_aliasing() -> None:
    t = torch.ones(3)
    (b,) = list(prefetch([{"a": t, "b": t}], device="meta"))
    assert b["a"] is b["b"]
