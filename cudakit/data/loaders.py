"""DataLoader settings: :func:`loader_kwargs` picks workers and pinning for a device."""

from __future__ import annotations

import os
from typing import TypedDict

from .._check import check_device, check_int, check_optional, check_type
from .._dist import launched_local_world_size
from ..device import DeviceLike, resolve_device

__all__ = ["MAX_AUTO_WORKERS", "LoaderKwargs", "loader_kwargs"]

#: Most worker processes :func:`loader_kwargs` picks on its own; more rarely pays.
MAX_AUTO_WORKERS = 8


class LoaderKwargs(TypedDict, total=False):
    """Keyword arguments for :class:`torch.utils.data.DataLoader` from :func:`loader_kwargs`.

    >>> from cudakit.data import loader_kwargs
    >>> sorted(loader_kwargs("cpu"))
    ['num_workers', 'persistent_workers', 'pin_memory']

    .. versionadded:: 0.1
    """

    num_workers: int
    pin_memory: bool
    persistent_workers: bool


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours taskset / container CPU sets
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _choose_loader_kwargs(device_type: str, cpus: int, local_world_size: int) -> LoaderKwargs:
    """The pure decision behind :func:`loader_kwargs` (tested for every case)."""
    if device_type in ("cuda", "mps"):
        # Leave one core per process for the training loop itself.
        per_process = max(1, cpus // max(1, local_world_size))
        workers = max(0, min(MAX_AUTO_WORKERS, per_process - 1))
    else:
        # On the CPU the model's own threads already use every core.
        workers = 0
    return {
        "num_workers": workers,
        "pin_memory": device_type == "cuda",
        "persistent_workers": workers > 0,
    }


def loader_kwargs(
    device: DeviceLike = None,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
) -> LoaderKwargs:
    """Choose DataLoader ``num_workers``, ``pin_memory`` and ``persistent_workers`` for a device.

    * CUDA: ``pin_memory=True`` (host-to-device copies by DMA, which :func:`prefetch`
      then overlaps with compute); one worker per spare core of this process's share
      of the machine (cores divided by ``LOCAL_WORLD_SIZE``, minus one for the
      training loop, at most :data:`MAX_AUTO_WORKERS`), kept alive across epochs.
    * MPS: the same workers, no pinning (torch does not pin for MPS).
    * CPU and others: no workers and no pinning: the model's threads use every core.

    ``pin_memory_device`` is never set: torch deprecated it, and torch 2.13's DataLoader
    ignores it with a warning, pinning for the current accelerator (pinned memory is
    readable by every GPU). The pin-memory thread runs on the current CUDA device, so
    under ``torchrun`` call ``torch.cuda.set_device(local_rank)`` before iterating.
    Never initialises CUDA.

    >>> from torch.utils.data import DataLoader
    >>> from cudakit.data import loader_kwargs
    >>> loader_kwargs("cpu")
    {'num_workers': 0, 'pin_memory': False, 'persistent_workers': False}
    >>> loader = DataLoader(range(10), batch_size=4, **loader_kwargs("cpu"))

    Args:
        device: The device batches are for; ``None``/``"auto"`` picks the best one.
        num_workers: Override the worker count (``persistent_workers`` follows it
            unless given too).
        pin_memory: Override pinning; ``True`` needs a CUDA device.
        persistent_workers: Override; ``True`` needs ``num_workers > 0``.

    Returns:
        A dict to splat into ``DataLoader(dataset, batch_size=..., **kwargs)``.

    Raises:
        TypeError: an override has the wrong type.
        ValueError: an override contradicts the device or the other settings.
        DeviceError: ``device`` does not exist on this machine.

    .. versionadded:: 0.1
    """
    fn = "loader_kwargs"
    num_workers = check_optional(
        check_int,
        fn,
        "num_workers",
        num_workers,
        minimum=0,
        fix="Leave it out to let cudakit choose, or pass 0 to load in the main process.",
    )
    for name, value in (("pin_memory", pin_memory), ("persistent_workers", persistent_workers)):
        check_optional(
            check_type,
            fn,
            name,
            value,
            types=bool,
            expected="True, False or None (let cudakit choose)",
            fix=f"Pass {name}=True or {name}=False, or leave it out to let cudakit choose.",
        )
    dev = check_device("loader_kwargs", "device", device, resolve_device)
    chosen = _choose_loader_kwargs(dev.type, _available_cpus(), launched_local_world_size())
    if num_workers is not None:
        chosen["num_workers"] = num_workers
        chosen["persistent_workers"] = num_workers > 0
    if pin_memory is not None:
        if pin_memory and dev.type != "cuda":
            raise ValueError(
                f"loader_kwargs(pin_memory=True) only speeds up copies to a CUDA device, but "
                f"the device is {str(dev)!r} (and torch warns when it cannot pin). Leave "
                "pin_memory out, or pass device='cuda'."
            )
        chosen["pin_memory"] = pin_memory
    if persistent_workers is not None:
        if persistent_workers and chosen["num_workers"] == 0:
            raise ValueError(
                "loader_kwargs(persistent_workers=True) needs worker processes, but "
                f"num_workers is 0 for device {str(dev)!r}. Pass num_workers=N (N > 0) as "
                "well, or leave persistent_workers out."
            )
        chosen["persistent_workers"] = persistent_workers
    return chosen
