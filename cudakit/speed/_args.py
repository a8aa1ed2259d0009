"""The checks of :func:`~cudakit.speed.speed_report`'s arguments, and what they decide."""

from __future__ import annotations

from dataclasses import dataclass
from typing import IO, Any

import torch

from .._accel import follows_current_device
from .._check import (
    check_bool,
    check_device,
    check_int,
    check_number,
    check_optional,
    check_type,
    fail_type,
    fail_value,
)
from .._output import LogTarget, Stderr, check_file, check_log
from ..amp import AutocastStep
from ..device import DeviceLike, resolve_device
from ..exceptions import DeviceError
from .counts import CallCounter, check_spec
from .peaks import DTYPE_KEYS, dtype_key

__all__ = ["Settings", "settle", "step_of"]

_FUNC = "speed_report"


@dataclass(frozen=True)
class Settings:
    """What a meter was asked for, checked and decided once."""

    label: str | None
    device: torch.device
    follow: bool  # the device is "this thread's current CUDA device"
    counter: CallCounter
    step: AutocastStep | None
    accumulate: int | None
    dtype: Any  # a torch.dtype, a key of the peak table, or None (the step's, else fp32)
    peak_tflops: float | None
    every: int | None
    window: int
    file: IO[str] | Stderr | None
    log: LogTarget | None
    combine: bool
    start: int = 0  # optimizer steps done before this meter's first (a resumed run's)
    loss: bool = False  # show the loss the decorated function returns in the line


def step_of(value: object) -> AutocastStep | None:
    """The :class:`AutocastStep` of ``value``: the step, or a function it decorated."""
    if isinstance(value, AutocastStep):
        return value
    inner = getattr(value, "autocast_step", None)
    return inner if isinstance(inner, AutocastStep) else None


def _check_dtype(dtype: object) -> object:
    if dtype is None or dtype_key(dtype) is not None:
        return dtype
    names = ", ".join(repr(k) for k in DTYPE_KEYS)
    expected = f"a floating torch.dtype or one of {names}"
    fix = "It picks the peak the MFU is measured against, e.g. dtype=torch.bfloat16."
    if isinstance(dtype, (torch.dtype, str)):
        fail_value(_FUNC, "dtype", expected, dtype, fix)
    fail_type(_FUNC, "dtype", expected, dtype, fix)


def _device(device: DeviceLike, step: AutocastStep | None) -> torch.device:
    if device is None and step is not None:
        device = step.device_type
    resolved = check_device(_FUNC, "device", device, resolve_device)
    if resolved.type == "meta":
        raise DeviceError(
            f"{_FUNC}(device={device!r}): nothing runs on the meta device, so there is "
            "nothing to time. Pass the device the step runs on, or leave device= out."
        )
    return resolved


def settle(
    label: str | None,
    *,
    samples: object,
    tokens: object,
    flops: object,
    accumulate: object,
    step: object,
    dtype: object,
    peak_tflops: object,
    device: DeviceLike,
    every: object,
    window: object,
    file: object,
    log: object,
    combine: object,
    start: object = 0,
    loss: object = False,
) -> Settings:
    """Check every argument, then decide; raises before anything is made."""
    check_optional(
        check_type,
        _FUNC,
        "label",
        label,
        types=str,
        expected="a string naming what is measured, or None",
        fix="For example: speed_report('train').",
    )
    checked_file = check_file(_FUNC, file)
    checked_log = check_log(_FUNC, log)
    for name, value in (("samples", samples), ("tokens", tokens), ("flops", flops)):
        check_spec(_FUNC, name, value)
    acc = check_optional(check_int, _FUNC, "accumulate", accumulate, minimum=1)
    the_step = step_of(step)
    if step is not None and the_step is None:
        fail_type(
            _FUNC,
            "step",
            "an autocast_step(...) object or a function it decorated",
            step,
            "Its accumulation windows are then the meter's optimizer steps; for another loop "
            "pass accumulate=N instead.",
        )
    if the_step is not None and acc is not None:
        raise ValueError(
            f"{_FUNC}() got both step= and accumulate={acc}: the step says when a window "
            "ends (its accumulate may change between windows). Drop accumulate=."
        )
    every_n = check_optional(check_int, _FUNC, "every", every, minimum=1)
    window_n = check_int(_FUNC, "window", window, minimum=1, fix="For example: window=100.")
    peak = check_optional(
        check_number,
        _FUNC,
        "peak_tflops",
        peak_tflops,
        positive=True,
        fix="It is the device's dense peak in TFLOP/s for the dtype trained in, e.g. 989.5.",
    )
    check_bool(_FUNC, "combine", combine)
    check_bool(_FUNC, "loss", loss)
    start_n = check_int(
        _FUNC,
        "start",
        start,
        minimum=0,
        fix="It is the optimizer steps a resumed run has done, e.g. start=ckpt.position.windows.",
    )
    checked_dtype = _check_dtype(dtype)
    dev = _device(device, the_step)
    counter = CallCounter(samples, tokens, flops)  # type: ignore[arg-type]
    return Settings(
        label,
        dev,
        follows_current_device(device) and dev.type == "cuda",
        counter,
        the_step,
        acc,
        checked_dtype,
        peak,
        every_n,
        window_n,
        checked_file,
        checked_log,
        bool(combine),
        start_n,
        bool(loss),
    )
