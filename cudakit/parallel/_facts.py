"""What :func:`~cudakit.parallel.parallelize` needs to know about this process, read once.

:func:`gather_facts` is the one function of the parallel package's decisions that
looks at the process: the launcher's variables, a running group, the GPUs and the
requested device, each read once, into a :class:`ParallelFacts` that
:func:`~cudakit.parallel.strategy.choose_plan` turns into a plan without touching
anything. Both are public from :mod:`cudakit.parallel.strategy`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NoReturn

import torch

from .._accel import current_cuda_index
from .._check import check_bool, check_int, fail_type
from .._dist import DistributedEnv, group_world_size, is_group_running, read_launcher_env
from ..device import DeviceLike, resolve_device
from ..device.resolve import resolve_spec
from ..exceptions import DeviceError

__all__ = ["ParallelFacts", "gather_facts", "requested_device"]


@dataclasses.dataclass(frozen=True)
class ParallelFacts:
    """What :func:`choose_plan` needs to know about this process, read once.

    .. versionadded:: 0.1
    """

    env: DistributedEnv | None  # the launcher's variables; None outside a launcher
    group_world_size: int | None  # the running default group's size; None without one
    cuda_available: bool
    device_count: int  # visible CUDA devices (0 without CUDA)
    current_cuda_index: int | None  # the current CUDA device (0 before CUDA starts)
    requested_device: torch.device | None  # an explicit device, checked; None: the rank's own
    best_device: torch.device  # what device="auto" gives outside a launcher

    def __post_init__(self) -> None:
        # Facts built by hand (as docs/parallel.md shows) are checked like any argument.
        if self.env is not None and not isinstance(self.env, DistributedEnv):
            _fail_field("env", "a cudakit.parallel.DistributedEnv or None", self.env)
        _check_count("group_world_size", self.group_world_size, minimum=1, optional=True)
        check_bool("ParallelFacts", "cuda_available", self.cuda_available)
        _check_count("device_count", self.device_count, minimum=0, optional=False)
        _check_count("current_cuda_index", self.current_cuda_index, minimum=0, optional=True)
        if self.requested_device is not None and not isinstance(
            self.requested_device, torch.device
        ):
            _fail_field("requested_device", "a torch.device or None", self.requested_device)
        if not isinstance(self.best_device, torch.device):
            _fail_field("best_device", "a torch.device", self.best_device)


_FACTS_FIX = (
    "Read the facts with cudakit.parallel.strategy.gather_facts(device, strict_env=False, "
    "func='...'), or build them as docs/parallel.md shows."
)


def _fail_field(name: str, expected: str, value: object) -> NoReturn:
    fail_type("ParallelFacts", name, expected, value, _FACTS_FIX)


def _check_count(name: str, value: object, *, minimum: int, optional: bool) -> None:
    if optional and value is None:
        return
    expected = f"an int >= {minimum}" + (" or None" if optional else "")
    check_int("ParallelFacts", name, value, minimum=minimum, expected=expected, fix=_FACTS_FIX)


def requested_device(func: str, device: DeviceLike, *, cuda_available: bool) -> torch.device | None:
    """``device`` resolved and checked; ``None`` when it asks for this rank's own device.

    ``None``, ``"auto"`` and a bare ``"cuda"`` (with CUDA) mean the rank's own device,
    ``cuda:LOCAL_RANK``. Anything else must exist here: ``TypeError`` for a wrong
    kind, :class:`~cudakit.exceptions.DeviceError` for a device this machine lacks,
    each message starting with ``func(device=...)``.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return None
    bare_cuda = (isinstance(device, str) and device == "cuda") or (
        isinstance(device, torch.device) and device.type == "cuda" and device.index is None
    )
    if bare_cuda and cuda_available:
        return None
    try:
        return resolve_spec(device)  # without CUDA, "cuda" is the clear DeviceError
    except (TypeError, DeviceError) as err:
        raise type(err)(f"{func}(device=...): {err}") from None


def gather_facts(device: DeviceLike, *, strict_env: bool, func: str) -> ParallelFacts:
    """Read the launcher environment, the running group, the GPUs and ``device``, once.

    Never starts CUDA. ``strict_env=True`` makes any partial launcher environment
    an error (the callers that need a launcher); ``func`` names the caller in errors.

    Raises:
        DistributedSetupError: an incomplete or inconsistent launcher environment.
        DeviceError, TypeError: ``device`` cannot be used here (from ``resolve_device``).
    """
    env = read_launcher_env(os.environ, strict=strict_env)
    cuda = torch.cuda.is_available()
    requested = requested_device(func, device, cuda_available=cuda)
    return ParallelFacts(
        env=env,
        group_world_size=group_world_size() if is_group_running() else None,
        cuda_available=cuda,
        device_count=torch.cuda.device_count() if cuda else 0,
        current_cuda_index=current_cuda_index(),
        requested_device=requested,
        best_device=resolve_device(None),
    )
