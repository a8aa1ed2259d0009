"""Exceptions raised by cudakit.

Every cudakit error derives from :class:`CudakitError` *and* from the standard
exception type that describes it, so ``except ValueError`` keeps working. The
hierarchy:

    CudakitError
    ├── DeviceError(ValueError)              a device spec that cannot be honoured
    ├── NonFiniteStepsError(RuntimeError)    too many inf/NaN steps skipped in a row
    ├── BatchSizeSearchError(RuntimeError)   not even the smallest batch size fits
    ├── MemoryReserveError(ValueError)       warmup(reserve=...) beyond what is free
    ├── DistributedSetupError(RuntimeError)  an incomplete launcher environment
    ├── CheckpointError(ValueError)          a corrupted or mismatched checkpoint
    ├── CheckpointSaveError(OSError)         a checkpoint that could not be written
    └── LaunchError(RuntimeError)            a rank started by launch() failed

    ReserveIgnoredWarning(UserWarning)       warmup(reserve=...) ignored (CPU, MPS)
    CompiledWarmupWarning(UserWarning)       warmup() of a compiled model, no amp=
    TensorsLeftBehindWarning(UserWarning)    on_device() left tensors in an object

Plain argument mistakes (a wrong type, an out-of-range number) raise the plain
``TypeError``/``ValueError``; calls made in the wrong order raise ``RuntimeError``.
Every message says what was expected, what arrived and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BatchSizeSearchError",
    "CheckpointError",
    "CheckpointSaveError",
    "CompiledWarmupWarning",
    "CudakitError",
    "DeviceError",
    "DistributedSetupError",
    "LaunchError",
    "MemoryReserveError",
    "NonFiniteStepsError",
    "ReserveIgnoredWarning",
    "TensorsLeftBehindWarning",
]


class CudakitError(Exception):
    """Base class of every exception cudakit defines."""


class DeviceError(CudakitError, ValueError):
    """A device was requested that this machine cannot provide, or was misspelt."""


class NonFiniteStepsError(CudakitError, RuntimeError):
    """Too many optimizer steps in a row were skipped for non-finite values."""


class BatchSizeSearchError(CudakitError, RuntimeError):
    """A batch-size search could not find any batch size that fits."""


class DistributedSetupError(CudakitError, RuntimeError):
    """The distributed environment is incomplete or inconsistent."""


class CheckpointError(CudakitError, ValueError):
    """A checkpoint that cannot be loaded into this run: corrupted, incomplete, or saved
    from other models, optimizers or world sizes. The message names what differs.

    .. versionadded:: 0.1
    """


class CheckpointSaveError(CudakitError, OSError):
    """A checkpoint that could not be written (an unwritable directory, a full disk).

    Nothing of the failed save becomes visible; earlier checkpoints stay intact.

    .. versionadded:: 0.1
    """


class CompiledWarmupWarning(UserWarning):
    """``warmup()`` of a ``torch.compile``'d model without ``amp=``.

    The warm-up passes would compile the float32 graph, and the first training step
    under autocast would compile again. Pass ``amp=`` the ``autocast_step`` you train
    with (or the dtype); ``amp=torch.float32`` says float32 training is meant.

    .. versionadded:: 0.1
    """


class ReserveIgnoredWarning(UserWarning):
    """``warmup(reserve=...)`` was called for a device cudakit does not pre-fill (CPU, MPS).

    Filter it with ``warnings.filterwarnings("ignore", category=ReserveIgnoredWarning)``
    when the same script runs on CPU and GPU machines.

    .. versionadded:: 0.1
    """


class TensorsLeftBehindWarning(UserWarning):
    """:func:`~cudakit.device.on_device` left tensors behind inside an object it cannot rebuild.

    Raised once per type, in two cases:

    - an object of a type cudakit does not know (a ``SimpleNamespace``, a class
      without ``.to()``) is found holding tensors: the object comes back as it is, its
      tensors where they were. Teach cudakit the type with
      :func:`cudakit.register_container`, or give it a ``.to(device)`` method;
    - an object of a registered type holds tensors in attributes that its registered
      ``flatten`` does not return (a typo, a forgotten field): those tensors stay where
      they were, and the warning names the attributes. Add them to ``flatten``'s dict
      and let ``unflatten`` set them.

    Filter the warning with ``warnings.filterwarnings("ignore",
    category=TensorsLeftBehindWarning)`` if leaving them is what you want.

    .. versionadded:: 0.1
    """


class MemoryReserveError(CudakitError, ValueError):
    """``warmup(reserve=...)`` asked for more memory than the device has free.

    Raised before anything is allocated.

    .. versionadded:: 0.1
    """


class LaunchError(CudakitError, RuntimeError):
    """A process started by :func:`launch` failed; carries the rank and its traceback.

    Attributes:
        rank: the rank that failed first.
        pid: its process id.
        exitcode: its exit code (negative: killed by that signal), ``None`` if it
            was still running when it was stopped: it hung, either past the launch's
            ``timeout`` or while the other ranks gave up waiting for it in a
            collective (the process group's timeout), and the message says which.
        traceback_text: the child's formatted traceback (empty when it died
            without raising, e.g. from a signal or ``os._exit``).
        pids: the process ids of every rank (all terminated and reaped by then).

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None,
        pid: int | None,
        exitcode: int | None,
        traceback_text: str = "",
        pids: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.pids = list(pids or [])
        self.rank = rank
        self.pid = pid
        self.exitcode = exitcode
        self.traceback_text = traceback_text
