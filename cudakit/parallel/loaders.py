"""Data for several ranks: :func:`distributed_loader`, a shard per rank, reshuffled every epoch."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from .._check import (
    check_bool,
    check_callable,
    check_int,
    check_optional,
    check_type,
    fail_type,
)
from .ranks import rank, world_size

if TYPE_CHECKING:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["DistributedLoader", "distributed_loader"]

T_co = TypeVar("T_co", covariant=True)


class DistributedLoader(DataLoader[T_co]):
    """A ``DataLoader`` over this rank's shard that calls ``sampler.set_epoch`` by itself.

    >>> import torch, cudakit.parallel as cp
    >>> loader = cp.distributed_loader(
    ...     torch.utils.data.TensorDataset(torch.arange(4.0))
    ... )
    >>> isinstance(loader, torch.utils.data.DataLoader)
    True

    A real ``DataLoader`` subclass (``isinstance`` holds, and every ``DataLoader``
    attribute is its own) whose ``sampler`` is a ``DistributedSampler``. Each
    ``iter(loader)`` (each ``for batch in loader``) starts a new epoch with a new
    shuffle that every rank agrees on. Built by :func:`distributed_loader`.

    Attributes:
        epoch: the epoch the next ``for`` loop runs (counts up by itself).

    .. versionadded:: 0.1
    """

    sampler: DistributedSampler[T_co]

    def __init__(
        self, dataset: Dataset[T_co], *, sampler: DistributedSampler[T_co], **loader_kwargs: Any
    ) -> None:
        super().__init__(dataset, sampler=sampler, **loader_kwargs)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (to resume from a checkpoint)."""
        self.epoch = check_int(
            "DistributedLoader.set_epoch",
            "epoch",
            epoch,
            minimum=0,
            fix="Pass the epoch number, e.g. set_epoch(0).",
        )  # a NumPy int too

    def __iter__(self) -> _BaseDataLoaderIter:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()

    def __repr__(self) -> str:
        return (
            f"DistributedLoader(rank={self.sampler.rank}, num_replicas="
            f"{self.sampler.num_replicas}, batches={len(self)}, next_epoch={self.epoch})"
        )


_OWN = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def _check_dataset(dataset: object) -> None:
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            "distributed_loader() needs a map-style dataset (with __getitem__ and __len__), got "
            f"the IterableDataset {type(dataset).__name__}, which a sampler cannot shard. Shard "
            "inside its __iter__ with cudakit.parallel.rank() and world_size() instead."
        )
    if isinstance(dataset, (str, bytes)):
        fail_type(
            "distributed_loader",
            "dataset",
            "a map-style dataset (with __getitem__ and __len__)",
            dataset,
            "A path is not a dataset: build a Dataset that reads the files there (its "
            "__getitem__(i) returns sample i), and pass that.",
        )
    if (
        isinstance(dataset, Mapping)
        and not isinstance(dataset, Dataset)
        and not all(i in dataset for i in range(len(dataset)))
    ):
        # A sampler draws the ints 0..len-1: a dict keyed otherwise fails at the first batch.
        fail_type(
            "distributed_loader",
            "dataset",
            "a map-style dataset whose __getitem__ takes the int indices 0..len-1 that a "
            "sampler draws",
            dataset,
            "A dict is read by its keys: pass list(d.values()) for a dict of samples, or "
            "TensorDataset(d['x'], d['y']) for a dict of columns.",
        )
    kind = type(dataset)
    if not (hasattr(kind, "__getitem__") and hasattr(kind, "__len__")):
        fail_type(
            "distributed_loader",
            "dataset",
            "a map-style dataset (with __getitem__ and __len__)",
            dataset,
            "Pass e.g. torch.utils.data.TensorDataset(x, y) or a list of samples. A stream "
            "(a generator or an iterator) cannot be sharded by a sampler: materialise it with "
            "list(...), or make it an IterableDataset that shards inside __iter__ with "
            "cudakit.parallel.rank() and world_size().",
        )


def _check_loader_kwargs(loader_kwargs: dict[str, Any]) -> None:
    for bad in ("sampler", "batch_sampler"):
        if bad in loader_kwargs:
            raise TypeError(
                f"distributed_loader() makes its own DistributedSampler, so {bad}= cannot be "
                "passed. Build DataLoader(dataset, sampler=DistributedSampler(...)) yourself and "
                "call sampler.set_epoch(epoch) every epoch if you need a custom sampler."
            )
    for arg in ("collate_fn", "worker_init_fn"):
        check_optional(
            check_callable,
            "distributed_loader",
            arg,
            loader_kwargs.get(arg),
            expected="a function or None",
            fix=f"Pass {arg}=my_function (a def or a lambda), or leave it out for "
            "DataLoader's default.",
        )
    params = inspect.signature(DataLoader.__init__).parameters
    valid = [p for p in params if p not in ("self", *_OWN)]
    unknown = [k for k in loader_kwargs if k not in valid]
    if unknown:
        raise TypeError(
            f"distributed_loader() got keyword argument(s) {', '.join(map(repr, unknown))} "
            f"that DataLoader does not accept. Valid: {', '.join(valid)}."
        )


def distributed_loader(
    dataset: Dataset[T_co],
    batch_size: int | None = 1,
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
    of batches and no rank waits forever in an all-reduce; with ``drop_last=True``
    the remainder is dropped instead, so no sample is seen twice). Each ``for`` loop over
    the loader calls ``sampler.set_epoch(epoch)`` first: forgetting it is the classic
    bug that repeats the same order every epoch. The result is a
    :class:`DistributedLoader`, a ``DataLoader`` subclass.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: samples per batch on each rank (``None``: single samples, as in
            ``DataLoader``).
        shuffle: shuffle (identically seeded on every rank).
        seed: the shuffle seed, the same on every rank.
        drop_last: no repeats: the samples that do not divide evenly across the
            ranks are dropped (``DistributedSampler(drop_last=True)``), then the last
            incomplete batch of each rank.
        **loader_kwargs: other ``DataLoader`` options (``num_workers``, ``pin_memory``...).

    Returns:
        A ``DistributedLoader``.

    Raises:
        TypeError: a dataset that is not map-style (an ``IterableDataset``, a
            generator, ``None``, a path) or that the sampler's indices ``0..len-1``
            cannot read (a ``dict`` keyed otherwise), an argument of the wrong kind (a
            ``collate_fn`` or ``worker_init_fn`` that is not callable), a
            ``sampler``/``batch_sampler`` argument or an option ``DataLoader`` lacks.
        ValueError: ``batch_size`` < 1, or a ``seed`` out of the 64-bit range; an option
            ``DataLoader`` refuses (``prefetch_factor`` or ``persistent_workers=True``
            without worker processes, a negative ``timeout``), named in the message.

    .. versionadded:: 0.1
    """
    _check_dataset(dataset)
    if batch_size is not None:
        batch_size = check_int("distributed_loader", "batch_size", batch_size, minimum=1)
    check_bool("distributed_loader", "shuffle", shuffle)
    seed = check_int("distributed_loader", "seed", seed, minimum=-(2**63), maximum=2**63 - 1)
    check_bool("distributed_loader", "drop_last", drop_last)
    if batch_size is None and drop_last:
        raise ValueError(
            "distributed_loader(): drop_last=True needs a batch_size; batch_size=None yields "
            "single samples, so there is no last batch to drop. Pass batch_size=... or "
            "drop_last=False."
        )
    _check_loader_kwargs(loader_kwargs)
    if "num_workers" in loader_kwargs:
        loader_kwargs["num_workers"] = check_int(
            "distributed_loader",
            "num_workers",
            loader_kwargs["num_workers"],
            minimum=0,
            fix="Pass 0 to load in the main process.",
        )
    for flag in ("pin_memory", "persistent_workers", "in_order"):
        if flag in loader_kwargs:
            check_bool("distributed_loader", flag, loader_kwargs[flag])
    generator = loader_kwargs.get("generator")
    check_optional(
        check_type,
        "distributed_loader",
        "generator",
        generator,
        types=torch.Generator,
        expected="a torch.Generator or None",
        fix="The shuffle is seeded by seed=...; leave generator= out.",
    )
    sampler: DistributedSampler[T_co] = DistributedSampler(
        dataset,
        num_replicas=world_size(),
        rank=rank(),
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    try:
        return DistributedLoader(
            dataset, sampler=sampler, batch_size=batch_size, drop_last=drop_last, **loader_kwargs
        )
    except (TypeError, ValueError) as exc:  # DataLoader's own checks of its options
        given = ", ".join(f"{k}={v!r}" for k, v in loader_kwargs.items()) or "no options"
        raise type(exc)(
            f"distributed_loader(): DataLoader refused the options ({given}): {exc}. Change "
            "the option it names, e.g. pass num_workers=N (N > 0) with prefetch_factor= or "
            "persistent_workers=True."
        ) from exc
