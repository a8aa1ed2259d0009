"""Take one batch from a loader without a trace: :func:`example_batch`."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from .._check import fail_type, fail_value, is_int
from .preserve import RngState

__all__ = ["example_batch"]

T = TypeVar("T")


def _generators(loader: object) -> tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects a loader's sampling draws from (its own, its sampler's)."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (
        loader,
        getattr(loader, "sampler", None),
        getattr(batch_sampler, "sampler", None),
    ):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
    return tuple(found)


def example_batch(loader: Iterable[T], /) -> T:
    """Return the first batch of ``loader`` and leave every random number generator as it was.

    ``next(iter(loader))`` on a shuffling ``DataLoader`` draws from the global torch RNG
    (the shuffle order, the workers' seeds), so a run that takes a warm-up batch that
    way trains differently from the same run without it. This draws the batch with the
    CPU, CUDA, ``random`` and NumPy generators saved and restored, and the loader's own
    ``generator=`` (and its sampler's) too, so the first real epoch sees the same order
    as it would have without the warm-up.

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from cudakit.warmup import example_batch
    >>> loader = DataLoader(
    ...     TensorDataset(torch.arange(8.0)), batch_size=4, shuffle=True
    ... )
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> before = torch.get_rng_state()
    >>> (x,) = example_batch(loader)
    >>> x.shape, torch.equal(torch.get_rng_state(), before)
    (torch.Size([4]), True)

    Args:
        loader: A re-iterable source of batches: a ``DataLoader``, a list, any object
            whose ``iter()`` starts afresh. Not an iterator or generator, whose first
            item would be gone from the real run.

    Returns:
        The first batch, as the loader yields it (move it with ``on_device``).

    Raises:
        TypeError: ``loader`` is an iterator or generator, or not iterable; or it iterates
            into something other than batches: a path (``str``, ``bytes``,
            ``os.PathLike``), a tensor or numpy array (its rows), a dict (its keys: of a
            dict of loaders, pass one of them).
        ValueError: ``loader`` yields nothing.

    .. versionadded:: 0.1
    """
    _refuse_non_loaders(loader)
    if isinstance(loader, Iterator):
        fail_type(
            "example_batch",
            "loader",
            "a re-iterable loader (a DataLoader, a list)",
            loader,
            "Taking a batch from an iterator removes it from the training run; pass the "
            "DataLoader (or list) itself.",
        )
    if not isinstance(loader, Iterable):
        fail_type(
            "example_batch",
            "loader",
            _EXPECTED,
            loader,
            "Pass the loader you train with, e.g. example_batch(train_loader).",
        )
    rng = RngState(_generators(loader))
    epochs = _epoch_counters(loader)
    # A DataLoader with persistent workers keeps the iterator its first iter() made
    # (None until then); its first epoch must still make its own (drawing its seed).
    dl = _data_loader(loader)
    fresh = dl is not None and dl._iterator is None
    try:
        for batch in loader:
            return batch
    finally:
        if fresh and dl is not None:
            _drop_iterator(dl)
        rng.restore()
        for owner, epoch in epochs:  # a DistributedLoader counts iter() calls as epochs
            owner.epoch = epoch
    fail_value(
        "example_batch",
        "loader",
        "a loader that yields at least one batch",
        loader,
        "Check the dataset's length and drop_last= against batch_size=.",
    )


_EXPECTED = "a DataLoader or an iterable of batches (a list of batches, say)"


def _refuse_non_loaders(loader: object) -> None:
    """Refuse what iterates, but not into batches: a path, a tensor or array, a mapping."""
    if isinstance(loader, (str, bytes, os.PathLike)):
        fix = (
            "A path is not a loader: build a Dataset that reads the files there and pass "
            "DataLoader(dataset, batch_size=...)."
        )
    elif isinstance(loader, torch.Tensor):
        fix = (
            "A tensor is one batch, not a loader (iterating it gives its first row): use it "
            "as the example batch as it is, or pass DataLoader(TensorDataset(x), "
            "batch_size=...) to take a batch of its rows."
        )
    elif hasattr(type(loader), "__array_interface__"):  # numpy's ndarray, without numpy
        fix = (
            "A numpy array is one batch, not a loader (iterating it gives its first row): use "
            "it as the example batch as it is, or pass DataLoader(TensorDataset("
            "torch.from_numpy(x)), batch_size=...) to take a batch of its rows."
        )
    elif isinstance(loader, Mapping):
        key = next(iter(loader), "train")
        fix = (
            "Iterating a dict gives its keys, not batches: pass one of its loaders, e.g. "
            f"example_batch(loaders[{key!r}]), or, if it is a batch already, use it as the "
            "example batch as it is."
        )
    else:
        return
    fail_type("example_batch", "loader", _EXPECTED, loader, fix)


def _data_loader(loader: object) -> torch.utils.data.DataLoader[Any] | None:
    """The DataLoader under ``loader``: itself, or what a wrapper (``prefetch``) holds."""
    for _ in range(4):  # wrappers of wrappers, a few deep
        if isinstance(loader, torch.utils.data.DataLoader):
            return loader
        inner = getattr(loader, "loader", None)
        if inner is None or inner is loader:
            return None
        loader = inner
    return None


def _drop_iterator(loader: torch.utils.data.DataLoader[Any]) -> None:
    """Forget (and stop the workers of) the persistent iterator this call made."""
    made = loader._iterator
    if made is None:
        return
    loader._iterator = None
    shutdown = getattr(made, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def _epoch_counters(loader: object) -> list[tuple[Any, int]]:
    """``(object, epoch)`` for the loader and its samplers that keep an ``epoch`` count."""
    found: list[tuple[Any, int]] = []
    for owner in (
        loader,
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        epoch = getattr(owner, "epoch", None)
        if is_int(epoch):
            found.append((owner, epoch))
    return found
