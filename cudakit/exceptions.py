"""Exceptions raised by cudakit.

Every cudakit error derives from :class:`CudakitError` *and* from the standard
exception type that describes it, so ``except ValueError`` keeps working::

    CudakitError
    ├── DeviceError(ValueError)              a device spec that cannot be honoured
    ├── NonFiniteStepsError(RuntimeError)    too many skipped (inf/NaN) steps in a row
    ├── BatchSizeSearchError(RuntimeError)   not even the lower batch-size bound fits
    └── DistributedSetupError(RuntimeError)  a launcher environment that is incomplete

Plain argument mistakes (a wrong type, an out-of-range number) raise the plain
``TypeError``/``ValueError``; calls made in the wrong order raise ``RuntimeError``.
Every message says what was expected, what arrived and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BatchSizeSearchError",
    "CudakitError",
    "DeviceError",
    "DistributedSetupError",
    "NonFiniteStepsError",
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
