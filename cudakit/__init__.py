"""cudakit: fast, correct PyTorch training on NVIDIA GPUs without rewriting the loop.

Five composable utilities, each a plain call, a decorator or a ``with`` block:
:func:`on_device`, :func:`autocast_step`, :func:`warmup`, :func:`memory_report`
and :func:`parallelize`, plus device detection and data-loading helpers.
"""

from ._version import __version__
from .device import DeviceLike, resolve_device
from .exceptions import (
    BatchSizeSearchError,
    CudakitError,
    DeviceError,
    DistributedSetupError,
    NonFiniteStepsError,
)

__all__ = [
    "BatchSizeSearchError",
    "CudakitError",
    "DeviceError",
    "DeviceLike",
    "DistributedSetupError",
    "NonFiniteStepsError",
    "__version__",
    "resolve_device",
]
