"""Which devices a report measures: ``device=`` resolved to ``(name, cuda_index_or_-1)`` pairs."""

from __future__ import annotations

from typing import Final, Literal

from .._check import check_device
from ..device import DeviceLike, resolve_device
from ..exceptions import DeviceError
from . import _probes

__all__ = ["CPU_TARGET", "Target", "targets"]

Target = tuple[str, int]
CPU_TARGET: Final = (("cpu", -1),)


def targets(device: DeviceLike | Literal["all"], who: str) -> tuple[Target, ...]:
    """Resolve ``device=`` to ``((name, cuda_index_or_-1), ...)``."""
    if device == "cpu":
        return CPU_TARGET
    cuda = _probes.cuda
    if isinstance(device, str) and device == "all":
        if not cuda.is_available() or cuda.device_count() == 0:
            raise DeviceError(
                f"{who}(device='all') reports every visible CUDA device, but this machine has "
                "none (CUDA is not available). Use device=None to follow resolve_device(), or "
                "device='cpu' for the process's resident memory."
            )
        return tuple((f"cuda:{i}", i) for i in range(cuda.device_count()))
    dev = check_device(who, "device", device, resolve_device)
    if dev.type == "cuda":
        index = 0 if dev.index is None else dev.index
        return ((f"cuda:{index}", index),)
    if dev.type == "cpu" or device is None or device == "auto":
        # "auto" on a Mac resolves to MPS: fall back quietly to the process's memory.
        return CPU_TARGET
    raise DeviceError(
        f"{who}() measures CUDA devices and the CPU process, got device={device!r} ({dev.type}). "
        "Use device='cuda:N', 'all' or 'cpu' (on Apple MPS, 'cpu' reports the process's RSS)."
    )
