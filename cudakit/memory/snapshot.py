"""The memory of a device now: :func:`memory_snapshot`."""

from __future__ import annotations

from typing import Literal, overload

from ..device import DeviceLike
from ._frames import STACK
from ._targets import targets
from .results import MemorySnapshot

__all__ = ["memory_snapshot"]


@overload
def memory_snapshot(device: Literal["all"]) -> list[MemorySnapshot]: ...  # type: ignore[overload-overlap]


@overload
def memory_snapshot(device: DeviceLike = None) -> MemorySnapshot: ...


def memory_snapshot(
    device: DeviceLike | Literal["all"] = None,
) -> MemorySnapshot | list[MemorySnapshot]:
    """Return the memory of a device now, without resetting any peak.

    >>> from cudakit.memory import memory_snapshot
    >>> snap = memory_snapshot("cpu")
    >>> snap.device, snap.allocated > 0, snap.peak_allocated >= snap.allocated
    ('cpu', True, True)

    Args:
        device: as in :func:`memory_report`: ``None``, ``"cuda:N"``, ``"cpu"`` or
            ``"all"`` (every visible CUDA device, returned as a list).

    Returns:
        A ``MemorySnapshot``, or a list of them for ``device="all"``.

    Raises:
        DeviceError: the device does not exist or cannot be measured.

    .. versionadded:: 0.1
    """
    out: list[MemorySnapshot] = []
    for name, index in targets(device, "memory_snapshot"):
        with STACK.lock:
            out.append(STACK.now(name, index))
    if isinstance(device, str) and device == "all":
        return out
    return out[0]
