"""The data position: which epoch, how many batches of it, and how to get back there.

A plain ``DataLoader`` has no state of its own: its order comes from the random
number generators at the moment ``iter(loader)`` runs (a shuffling sampler draws its
seed there, a multi-worker loader its workers' base seed). So the position is the
epoch, the batches consumed in it, and the generators as they were when the epoch
began. Resuming mid-epoch puts those generators back, makes the iterator, skips the
consumed batches (their indices only, where the loader allows it), then puts the
save's own generators back. A loader with its own ``state_dict`` (torchdata's
``StatefulDataLoader``) is saved and restored by itself instead.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from ..warmup.preserve import RngState

__all__ = [
    "Position",
    "Yielded",
    "capture_rng",
    "fetched",
    "generators_of",
    "is_stateful",
    "loader_length",
    "numpy_state_from_plain",
    "numpy_state_to_plain",
    "restore_rng",
    "set_epoch",
]


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run stands: the next epoch and batch to run, and the totals so far.

    Returned by :meth:`Checkpointer.resume`: a fresh run is at ``Position(0, 0, 0, 0)``.

    Attributes:
        epoch: the epoch the run is in (or starts next).
        batch: batches of that epoch already consumed (0 at an epoch boundary).
        total: batches consumed since the run began, over every epoch.
        windows: accumulation windows finished (optimizer steps, skipped ones included).

    .. versionadded:: 0.1
    """

    epoch: int = 0
    batch: int = 0
    total: int = 0
    windows: int = 0


_new = object.__new__


def advance(pos: Position, batches: int, windows: int) -> Position:
    """``pos`` with ``batches`` more batches (of its epoch, and in all) and ``windows``
    more windows.

    The per-batch path of :class:`Checkpointer` (``maybe_save()``, ``batches()``): it
    fills the new instance's fields directly, as a frozen dataclass's ``__init__``
    would with one ``object.__setattr__`` per field (about 4x as long, and twice per
    batch).

    >>> advance(Position(1, 2, 10, 5), 1, 0)
    Position(epoch=1, batch=3, total=11, windows=5)
    >>> advance(Position(1, 2, 10, 5), 0, 1) == Position(1, 2, 10, 6)
    True
    """
    new = _new(Position)
    new.__dict__.update(
        epoch=pos.epoch,
        batch=pos.batch + batches,
        total=pos.total + batches,
        windows=pos.windows + windows,
    )
    return new


def is_stateful(loader: object) -> bool:
    """Whether ``loader`` saves its own position (``state_dict``/``load_state_dict``)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def _inner(loader: object) -> list[object]:
    """``loader`` and what it wraps (a prefetcher's loader), one level down."""
    found = [loader]
    for name in ("loader", "_loader", "dataloader"):
        inner = getattr(loader, name, None)
        if inner is not None and inner is not loader:
            found.append(inner)
    return found


def generators_of(loader: object) -> tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects a loader draws its order from (its own, its sampler's)."""
    gens: list[torch.Generator] = []
    for obj in _inner(loader):
        for owner in (
            obj,
            getattr(obj, "sampler", None),
            getattr(getattr(obj, "batch_sampler", None), "sampler", None),
        ):
            gen = getattr(owner, "generator", None)
            if isinstance(gen, torch.Generator) and all(gen is not g for g in gens):
                gens.append(gen)
    return tuple(gens)


def set_epoch(loader: object, epoch: int) -> None:
    """Tell a loader (or its ``DistributedSampler``) which epoch comes next."""
    for obj in _inner(loader):
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)  # type: ignore[attr-defined]
            return
        sampler = getattr(obj, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
            return


def is_sharded(loader: object) -> bool:
    """Whether the loader reads a per-rank shard (a ``DistributedSampler``)."""
    from torch.utils.data.distributed import DistributedSampler

    return any(
        isinstance(getattr(obj, "sampler", None), DistributedSampler) for obj in _inner(loader)
    )


def capture_rng(generators: tuple[torch.Generator, ...] = ()) -> dict[str, Any]:
    """Every generator's state now, as tensors and plain containers: what torch's safe
    loader (``torch.load(weights_only=True)``) reads back, NumPy's state included."""
    state = RngState(generators)
    return {
        "cpu": state.cpu,
        "cuda": state.cuda,
        "python": state.py,
        "numpy": numpy_state_to_plain(state.np),
        "generators": [s for _, s in state.generators],
    }


def numpy_state_to_plain(state: Any) -> dict[str, Any] | None:
    """``numpy.random.get_state()`` as a dict of a str, a tensor and numbers (no NumPy
    type), so that loading it needs neither NumPy's pickles nor NumPy itself."""
    if state is None:
        return None
    kind, keys, pos, has_gauss, gauss = state
    np = sys.modules["numpy"]
    return {
        "kind": str(kind),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def numpy_state_from_plain(saved: Any) -> Any:
    """The tuple ``numpy.random.set_state`` takes, from :func:`numpy_state_to_plain`'s
    dict (a tuple, as older checkpoints hold it, passes as it is)."""
    if not isinstance(saved, dict):
        return saved
    np = sys.modules["numpy"]
    keys = np.asarray(saved["keys"].numpy(), dtype=np.int64).astype(np.uint32)
    return (saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["gauss"])


def restore_rng(saved: dict[str, Any], generators: tuple[torch.Generator, ...] = ()) -> None:
    """Put the generators back as :func:`capture_rng` found them.

    CUDA states are restored only where CUDA runs already (a checkpoint from a GPU run
    loaded on a CPU-only machine leaves CUDA alone). The loader's own generators are
    restored when there are as many as were saved.
    """
    torch.set_rng_state(saved["cpu"])
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(saved["python"])
    np = sys.modules.get("numpy")
    if np is not None and saved.get("numpy") is not None:
        np.random.set_state(numpy_state_from_plain(saved["numpy"]))
    states = saved.get("generators") or []
    if len(states) == len(generators):
        for gen, gen_state in zip(generators, states, strict=True):
            gen.set_state(gen_state)


def skip_batches(iterator: Iterator[Any], count: int) -> None:
    """Advance a fresh loader iterator past ``count`` batches.

    A single-process ``DataLoader`` over a map-style dataset skips indices only (no
    batch is loaded); any other iterator fetches and drops the batches.
    """
    sampler_iter = getattr(iterator, "_sampler_iter", None)
    single = type(iterator).__name__ == "_SingleProcessDataLoaderIter"
    if single and sampler_iter is not None and getattr(iterator, "_dataset_kind", None) == 0:
        for _ in range(count):
            next(sampler_iter)
        iterator._num_yielded += count  # type: ignore[attr-defined]
        return
    for _ in range(count):
        next(iterator)


def loader_length(loader: Any) -> int | None:
    """Batches per epoch, or None for a loader without a length (an iterable dataset)."""
    try:
        return len(loader)
    except TypeError:
        return None


def fetched(iterator: Iterator[Any], rng: bool) -> Iterator[tuple[Any, torch.Tensor | None]]:
    """Each batch of ``iterator`` with torch's CPU RNG state from before it was fetched
    (``rng``; else None): a dataset's random augmentation draws from it (``num_workers=0``).

    About a microsecond a batch; :class:`~cudakit.checkpoint.Checkpointer` saves it for a
    ``save()`` taken before the batch's step, so that the resumed run fetches it alike.
    """
    while True:
        before = torch.get_rng_state() if rng else None
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield batch, before


class Yielded(NamedTuple):
    """The batch :meth:`~cudakit.checkpoint.Checkpointer.batches` yielded last, while it is
    the current one: what a ``save()`` before its step needs."""

    total: int  # the position's total with this batch
    marks: tuple[Any, ...]  # the steps' last backward (state.step_marks) at the yield
    rng: torch.Tensor | None  # torch's CPU RNG before the fetch (None: stateful loader)
    stateful: bool  # the loader saves its own position (it has moved past the batch)
    owner: object  # the generator that yielded it
