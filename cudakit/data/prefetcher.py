"""Prefetching: :func:`prefetch` yields batches already on the device.

On CUDA, :func:`prefetch` copies the next ``depth`` batches on a side stream from
pinned host memory while the current batch is being computed on, so the copy of
batch ``i + 1`` overlaps the compute of batch ``i`` (the data page draws it to scale):

    copy stream     | copy 1 | copy 2 | copy 3 | copy 4 |
    compute stream           | step 1 | step 2 | step 3 | step 4 |

On every other device it is a plain moving iterator: no threads, no look-ahead,
nothing beyond :func:`~cudakit.device.on_device` per batch.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar, overload

import torch

from .._check import check_device, check_int, fail_type
from .._tree import Staging, all_on_cpu, device_tensors_in, move_root
from ..device import DeviceLike, resolve_device

__all__ = ["Prefetcher", "SizedIterable", "SizedPrefetcher", "prefetch"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class SizedIterable(Protocol[T_co]):
    """An iterable with ``len()``, such as a ``DataLoader`` or a list of batches.

    :func:`prefetch` over one returns a :class:`SizedPrefetcher`, which has ``len()``
    too; over any other iterable (a generator) it returns a :class:`Prefetcher`. A type
    for annotations: any object with ``__len__`` and ``__iter__`` is one.

    .. versionadded:: 0.1
    """

    def __len__(self) -> int:
        """The number of batches an iteration yields."""

    def __iter__(self) -> Iterator[T_co]:
        """A fresh pass over the batches."""


# -- iterators ----------------------------------------------------------------------


def _close_owned(source: Iterator[Any] | None, owned: bool) -> None:
    if owned and source is not None:
        close = getattr(source, "close", None)
        if callable(close):
            close()


class _MovingIterator(Iterator[T]):
    """CPU and other devices: move each batch as it is asked for; nothing in flight."""

    __slots__ = ("_device", "_owns", "_source", "_to_cpu")

    def __init__(self, source: Iterator[T], device: torch.device, owns: bool) -> None:
        self._source: Iterator[T] | None = source
        self._device = device
        self._owns = owns
        self._to_cpu = device.type == "cpu"

    def __iter__(self) -> _MovingIterator[T]:
        return self

    def __next__(self) -> T:
        source = self._source
        if source is None:
            raise StopIteration
        try:
            batch = next(source)
            if self._to_cpu and all_on_cpu(batch):  # a CPU loop's batch: nothing to do
                return batch
            return move_root(batch, self._device, None, "batch")  # type: ignore[no-any-return]
        except BaseException:
            # StopIteration included: the epoch is over, let go of the source.
            self.close()
            raise

    def close(self) -> None:
        """Release the source iterator (closing it when prefetch created it)."""
        source, self._source = self._source, None
        _close_owned(source, self._owns)


class _LookaheadIterator(Iterator[T]):
    """Keep ``depth`` staged batches in flight ahead of the consumer.

    Subclasses say how a raw batch is staged (a copy started) and delivered
    (made safe to use). An error from the source or from staging is raised only
    after the batches before it have been delivered, as a plain loop would see it;
    ``KeyboardInterrupt`` and other ``BaseException``\\ s are raised at once.
    """

    def __init__(self, source: Iterator[Any], depth: int, owns: bool) -> None:
        self._source: Iterator[Any] | None = source
        self._depth = depth
        self._owns = owns
        self._queue: collections.deque[Any] = collections.deque()
        self._error: Exception | None = None

    def _stage(self, raw: Any) -> Any:
        raise NotImplementedError

    def _deliver(self, staged: Any) -> T:
        raise NotImplementedError

    def __iter__(self) -> _LookaheadIterator[T]:
        return self

    def _fill(self) -> None:
        while self._source is not None and len(self._queue) < self._depth:
            try:
                raw = next(self._source)
                staged = self._stage(raw)
            except StopIteration:
                self._drop_source()
                return
            except Exception as exc:
                self._error = exc
                self._drop_source()
                return
            except BaseException:
                self.close()
                raise
            self._queue.append(staged)

    def __next__(self) -> T:
        if len(self._queue) < self._depth:
            self._fill()
        if not self._queue:
            error, self._error = self._error, None
            self.close()
            if error is not None:
                raise error
            raise StopIteration
        try:
            batch = self._deliver(self._queue.popleft())
            self._fill()
        except BaseException:
            self.close()
            raise
        return batch

    def _drop_source(self) -> None:
        source, self._source = self._source, None
        _close_owned(source, self._owns)

    def close(self) -> None:
        """Drop every batch in flight and release the source iterator."""
        self._queue.clear()
        self._error = None
        self._drop_source()


class _CudaPrefetchIterator(_LookaheadIterator[T]):
    """Copy batches on a side stream; the consuming stream waits on a per-batch event."""

    def __init__(self, source: Iterator[Any], device: torch.device, depth: int, owns: bool):
        super().__init__(source, depth, owns)
        self._device = device
        self._side = torch.cuda.Stream(device)
        # Set when a delivered batch held a tensor record_stream cannot cover (sparse,
        # nested, a subclass without it, or one hidden inside a custom object moved by
        # its own .to()): from then on every copy waits for the compute stream instead,
        # so memory the user freed is never overwritten while still being read.
        self._order_after_compute = False

    def _stage(self, raw: Any) -> tuple[Any, torch.cuda.Event, Staging]:
        consumer = torch.cuda.current_stream(self._device)
        side = self._side
        if self._order_after_compute:
            side.wait_stream(consumer)
            first_device_tensor = None
        else:
            # Tensors already on a device were produced by kernels on the compute
            # stream: the first one the walk meets orders the copies after them.
            first_device_tensor = functools.partial(side.wait_stream, consumer)
        # One walk pins, copies and lists the tensors it made (to record them below).
        staging = Staging(pin=True, on_device_tensor=first_device_tensor)
        with torch.cuda.stream(side):
            moved = move_root(raw, self._device, True, "batch", staging)
            event = side.record_event()
        return moved, event, staging

    def _deliver(self, staged: tuple[Any, torch.cuda.Event, Staging]) -> T:
        batch, event, staging = staged
        consumer = torch.cuda.current_stream(self._device)
        consumer.wait_event(event)
        tensors = staging.created
        for obj in staging.opaque:
            # Moved by its own .to(): search it for the tensors that .to() made.
            if not device_tensors_in(obj, tensors):
                self._order_after_compute = True  # some tensors may have been missed
        for t in tensors:
            if t.layout is torch.strided and not t.is_nested:
                # Memory allocated on the side stream and used on the consumer:
                # the allocator must not hand it out again before the consumer is done.
                try:
                    t.record_stream(consumer)
                    continue
                except (RuntimeError, NotImplementedError, TypeError):
                    pass  # a tensor subclass without record_stream
            self._order_after_compute = True
        return batch  # type: ignore[no-any-return]


def _marking_last(source: Iterator[T], step: Any, length: int | None) -> Iterator[T]:
    """``source``'s batches, the last inside ``step.last_micro_step()``.

    With ``length`` the last is the ``length``-th; without, ``source`` is read one batch
    ahead to see its end (an error reading ahead comes after the batch before it).
    """
    try:
        if length is not None:
            for i, batch in enumerate(source, 1):
                if i == length:
                    with step.last_micro_step():
                        yield batch
                else:
                    yield batch
            return
        try:
            batch = next(source)
        except StopIteration:
            return
        while True:
            try:
                following = next(source)
            except StopIteration:
                with step.last_micro_step():
                    yield batch
                return
            except Exception:
                yield batch  # the batch before the error, as a plain loop sees it
                raise
            yield batch
            batch = following
    finally:
        close = getattr(source, "close", None)
        if callable(close):
            close()


def _length(loader: object) -> int | None:
    """``len(loader)``, or None where it has none (a DataLoader over an iterable dataset
    without ``__len__`` raises TypeError)."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_step(func: str, step: object) -> Any:
    """The ``AutocastStep`` of ``step=`` (or of the function it decorated); None stays."""
    if step is None:
        return None
    found = getattr(step, "autocast_step", step)
    if not callable(getattr(found, "last_micro_step", None)):
        fail_type(
            func,
            "step",
            "an autocast_step (or the function it decorated), or None",
            step,
            "pass the step the loop trains with, e.g. prefetch(loader, step=step): the "
            "epoch's last batch then syncs a partial window's gradients for flush().",
        )
    return found


# -- the public iterable -------------------------------------------------------------


class Prefetcher(Generic[T]):
    """An iterable of batches already on the device, made by :func:`prefetch`.

    Every ``iter()`` starts a fresh pass over the source (one epoch), so the same
    object serves every epoch. The iterator it returns has ``close()``; a loop that
    breaks or raises releases the source and every batch in flight.

    >>> import torch
    >>> from cudakit.data import prefetch
    >>> # no len(): a Prefetcher
    >>> batches = prefetch(x for x in torch.arange(3.0).split(1))
    >>> type(batches).__name__, [b.item() for b in batches]
    ('Prefetcher', [0.0, 1.0, 2.0])

    .. versionadded:: 0.1
    """

    __slots__ = ("_depth", "_device", "_loader", "_step")

    def __init__(
        self, loader: Iterable[T], device: torch.device, depth: int, *, step: Any = None
    ) -> None:
        name = type(self).__name__
        _check_source(loader, name)
        self._loader = loader
        self._device = check_device(name, "device", device, resolve_device)
        self._depth = _check_depth(name, depth)
        self._step = _check_step(name, step)

    @property
    def loader(self) -> Iterable[T]:
        """The wrapped source of batches."""
        return self._loader

    @property
    def device(self) -> torch.device:
        """The device batches are moved to."""
        return self._device

    @property
    def depth(self) -> int:
        """How many batches are copied ahead on CUDA (unused elsewhere)."""
        return self._depth

    def __iter__(self) -> Iterator[T]:
        source = iter(self._loader)
        # A fresh iterator made for us (a DataLoader's, a generator function's) is ours
        # to close; an iterator the user passed in stays theirs to resume.
        owns = source is not self._loader
        moved: Iterator[T]
        if self._device.type == "cuda":
            moved = _CudaPrefetchIterator(source, self._device, self._depth, owns)
        else:
            moved = _MovingIterator(source, self._device, owns)
        if self._step is None:
            return moved
        return _marking_last(moved, self._step, _length(self._loader))

    @property
    def step(self) -> Any:
        """The step whose ``last_micro_step()`` the epoch's last batch enters (or None)."""
        return self._step

    def set_epoch(self, epoch: int) -> None:
        """Pass ``set_epoch(epoch)`` on to the source or its (distributed) sampler.

        Calls ``loader.set_epoch`` when the source has one; otherwise
        ``loader.sampler.set_epoch``, ``loader.batch_sampler.set_epoch`` and
        ``loader.batch_sampler.sampler.set_epoch``, whichever exist. A source with
        none of them (no :class:`~torch.utils.data.DistributedSampler`) is left
        alone, so the same loop runs with one process or many.

        >>> import torch
        >>> from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        >>> from cudakit.data import prefetch
        >>> ds = TensorDataset(torch.arange(8))
        >>> sampler = DistributedSampler(ds, num_replicas=2, rank=0)
        >>> batches = prefetch(
        ...     DataLoader(ds, sampler=sampler, batch_size=4), device="cpu"
        ... )
        >>> batches.set_epoch(3)
        >>> sampler.epoch
        3

        Args:
            epoch: The epoch number about to start.

        Raises:
            TypeError: ``epoch`` is not an int.
            ValueError: ``epoch`` is negative.
        """
        epoch = check_int(
            f"{type(self).__name__}.set_epoch",
            "epoch",
            epoch,
            minimum=0,
            fix="Epochs count from 0; call it once per epoch: `for epoch in range(n): "
            "batches.set_epoch(epoch); for batch in batches: ...`.",
        )  # a NumPy int too
        for target in _epoch_targets(self._loader):
            target(epoch)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self._loader).__name__}, "
            f"device={str(self._device)!r}, depth={self._depth})"
        )


class SizedPrefetcher(Prefetcher[T]):
    """A :class:`Prefetcher` over a source with ``len()``, which it reports too.

    >>> import torch
    >>> from cudakit.data import prefetch
    >>> batches = prefetch([torch.zeros(2)] * 5, device="cpu")
    >>> type(batches).__name__, len(batches)
    ('SizedPrefetcher', 5)

    .. versionadded:: 0.1
    """

    __slots__ = ()

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]


def _epoch_targets(loader: object) -> list[Callable[[int], object]]:
    own = getattr(loader, "set_epoch", None)
    if callable(own):
        return [own]
    targets: list[Callable[[int], object]] = []
    seen: set[int] = set()
    batch_sampler = getattr(loader, "batch_sampler", None)
    for holder in (
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ):
        fn = getattr(holder, "set_epoch", None)
        if holder is not None and callable(fn) and id(holder) not in seen:
            seen.add(id(holder))
            targets.append(fn)
    return targets


def _check_source(loader: object, func: str = "prefetch") -> None:
    hint = (
        f"{func}(loader=...) expects an iterable of batches (a DataLoader, a list of batches, "
        "a generator)"
    )
    if isinstance(loader, torch.Tensor):
        raise TypeError(
            f"{hint}, got a single torch.Tensor of shape {tuple(loader.shape)}. Iterating it "
            "would yield its rows one by one; to move one tensor use "
            "cudakit.device.on_device(tensor), or wrap a list: prefetch([batch])."
        )
    if isinstance(loader, (str, bytes, bytearray)):
        raise TypeError(
            f"{hint}, got {type(loader).__name__} {loader!r}, which would iterate character "
            "by character. Pass the DataLoader, or a list of batches."
        )
    if isinstance(loader, Mapping):
        raise TypeError(
            f"{hint}, got a {type(loader).__name__}, which looks like a single batch: "
            "iterating it would yield its keys. Use cudakit.device.on_device(batch) for one "
            "batch, or prefetch([batch, ...]) for several."
        )
    if not isinstance(loader, Iterable) and not hasattr(loader, "__getitem__"):
        raise TypeError(
            f"{hint}, got {type(loader).__name__} {loader!r}, which is not iterable. Pass the "
            "DataLoader itself (not a batch or a count), or a list of batches."
        )


def _check_depth(func: str, depth: object) -> int:
    """``depth`` as an int (NumPy's too) >= 1."""
    return check_int(
        func,
        "depth",
        depth,
        minimum=1,
        fix="It counts the batches copied ahead of the one in use; the default depth=2 "
        "suits most loops. Use depth=1 for the least device memory, or plain "
        "on_device(batch) inside the loop for no look-ahead at all.",
    )


@overload
def prefetch(
    loader: SizedIterable[T], device: DeviceLike = None, depth: int = 2, *, step: Any = None
) -> SizedPrefetcher[T]: ...
@overload
def prefetch(
    loader: Iterable[T], device: DeviceLike = None, depth: int = 2, *, step: Any = None
) -> Prefetcher[T]: ...
def prefetch(
    loader: Iterable[T], device: DeviceLike = None, depth: int = 2, *, step: Any = None
) -> Prefetcher[T]:
    """Wrap an iterable of batches so that each arrives already on ``device``.

    Batches are moved with :func:`~cudakit.device.on_device`, so every container it
    supports keeps its type. On CUDA the next ``depth`` batches are pinned (when the
    DataLoader has not pinned them already) and copied on a side stream with
    ``non_blocking=True``; the compute stream waits for exactly the batch it gets,
    and each tensor is recorded on that stream so its memory is never reused early.
    On the CPU and other devices it is a plain moving iterator: no threads, no
    look-ahead.

    >>> import torch
    >>> from cudakit.data import prefetch
    >>> batches = prefetch(
    ...     [(torch.ones(2), torch.zeros(2)) for _ in range(3)], device="cpu"
    ... )
    >>> len(batches)
    3
    >>> [x.device.type for x, y in batches]
    ['cpu', 'cpu', 'cpu']

    Args:
        loader: Any iterable of batches: a DataLoader, a list, a generator. A
            re-iterable source gives a fresh pass on every ``iter()``; a one-shot
            iterator (a generator) is consumed once, and on CUDA up to ``depth``
            batches are read from it ahead of the one delivered. A source must yield a
            fresh tensor per batch, not refill one pinned buffer in place.
        device: Where batches go; ``None``/``"auto"`` picks the best device
            (see :func:`~cudakit.device.resolve_device`).
        depth: How many batches are copied ahead on CUDA; each costs one batch of
            device memory. Ignored on other devices.
        step: the :func:`~cudakit.autocast_step` the loop trains with (or the function
            it decorated): the epoch's last batch is yielded inside its
            ``last_micro_step()``, so under DDP or FSDP2 a partial window's last
            micro-step syncs in its own backward (communication hooks included) for
            ``flush()``. A source without ``len()`` is then read one batch ahead.

    Returns:
        A ``Prefetcher`` (a ``SizedPrefetcher`` with ``len()`` when the
        source has one) with ``set_epoch`` passed through to the source's sampler.

    Raises:
        TypeError: ``loader`` is not an iterable of batches (a tensor, a dict, a
            number), ``depth`` is not an int, or ``step`` is not an autocast_step.
        ValueError: ``depth`` is below 1.
        DeviceError: ``device`` does not exist on this machine.

    .. versionadded:: 0.1
    """
    _check_source(loader)
    depth = _check_depth("prefetch", depth)
    dev = check_device("prefetch", "device", device, resolve_device)
    found = _check_step("prefetch", step)
    if hasattr(loader, "__len__"):
        return SizedPrefetcher(loader, dev, depth, step=found)
    return Prefetcher(loader, dev, depth, step=found)
