"""Data for several ranks: :func:`distributed_loader`, a shard per rank, reshuffled every epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from .ranks import rank, world_size

__all__ = ["DistributedLoader", "distributed_loader"]

T_co = TypeVar("T_co", covariant=True)


class DistributedLoader(Generic[T_co]):
    """A ``DataLoader`` over this rank's shard that calls ``sampler.set_epoch`` by itself.

    Each ``iter(loader)`` (each ``for batch in loader``) starts a new epoch with a
    new shuffle that every rank agrees on. Attributes the ``DataLoader`` has
    (``dataset``, ``batch_size``, ...) are forwarded. Built by :func:`distributed_loader`.

    .. versionadded:: 0.1
    """

    def __init__(self, loader: DataLoader[T_co], sampler: DistributedSampler[T_co]) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (to resume from a checkpoint)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}.")
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "sampler", "epoch"):  # not yet set: avoid recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return (
            f"DistributedLoader(rank={self.sampler.rank}, num_replicas="
            f"{self.sampler.num_replicas}, batches={len(self)}, next_epoch={self.epoch})"
        )


def distributed_loader(
    dataset: Dataset[T_co],
    batch_size: int = 1,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> DistributedLoader[T_co]:
    """A ``DataLoader`` that gives this rank its shard and reshuffles every epoch by itself.

    >>> import torch, cudakit.parallel as cp
    >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> loader = cp.distributed_loader(data, batch_size=4, shuffle=False)
    >>> [batch[0].tolist() for batch in loader]       # one process: all of it
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]

    Under DDP each rank sees ``len(dataset) / world_size`` samples
    (``DistributedSampler``, padded with repeats so every rank gets the same number
    of batches and no rank waits forever in an all-reduce). Each ``for`` loop over
    the loader calls ``sampler.set_epoch(epoch)`` first: forgetting it is the classic
    bug that repeats the same order every epoch.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch on each rank.
        shuffle: shuffle (identically seeded on every rank).
        seed: the shuffle seed, the same on every rank.
        drop_last: drop the last incomplete batch of each rank.
        **loader_kwargs: other ``DataLoader`` options (``num_workers``, ``pin_memory``...).

    Returns:
        A :class:`DistributedLoader`.

    Raises:
        TypeError: an ``IterableDataset``, or a ``sampler``/``batch_sampler`` argument.

    .. versionadded:: 0.1
    """
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            "distributed_loader() needs a map-style dataset (with __getitem__ and __len__), got "
            f"the IterableDataset {type(dataset).__name__}, which a sampler cannot shard. Shard "
            "inside its __iter__ with cudakit.parallel.rank() and world_size() instead."
        )
    for bad in ("sampler", "batch_sampler"):
        if bad in loader_kwargs:
            raise TypeError(
                f"distributed_loader() makes its own DistributedSampler, so {bad}= cannot be "
                "passed. Build DataLoader(dataset, sampler=DistributedSampler(...)) yourself and "
                "call sampler.set_epoch(epoch) every epoch if you need a custom sampler."
            )
    sampler: DistributedSampler[T_co] = DistributedSampler(
        dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle, seed=seed
    )
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs
    )
    return DistributedLoader(loader, sampler)
