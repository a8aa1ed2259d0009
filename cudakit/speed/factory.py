"""The documented entry point: :func:`speed_report` checks its options and makes a
:class:`~cudakit.speed.meter.SpeedMeter`.

Its keyword signature is typed and documented here, once; the meter holds what a
measured call does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any, TypeVar, overload

import torch
from typing_extensions import ParamSpec

from .._output import STDERR, LogTarget, Stderr
from ..device import DeviceLike
from ._args import settle
from .counts import CountSpec, FlopSpec
from .meter import SpeedMeter, SpeedReported

__all__ = ["speed_report"]

P = ParamSpec("P")
R = TypeVar("R")


@overload
def speed_report(label: Callable[P, R], /) -> SpeedReported[P, R]: ...


@overload
def speed_report(
    label: str | None = None,
    *,
    samples: CountSpec = None,
    tokens: CountSpec = None,
    flops: FlopSpec = None,
    accumulate: int | None = None,
    step: Any = None,
    dtype: torch.dtype | str | None = None,
    peak_tflops: float | None = None,
    device: DeviceLike = None,
    every: int | None = 100,
    window: int = 100,
    file: IO[str] | None = ...,
    log: LogTarget | None = None,
    combine: bool = True,
    start: int = 0,
    loss: bool = False,
) -> SpeedMeter: ...


def speed_report(
    label: Callable[P, R] | str | None = None,
    *,
    samples: CountSpec = None,
    tokens: CountSpec = None,
    flops: FlopSpec = None,
    accumulate: int | None = None,
    step: Any = None,
    dtype: torch.dtype | str | None = None,
    peak_tflops: float | None = None,
    device: DeviceLike = None,
    every: int | None = 100,
    window: int = 100,
    file: IO[str] | Stderr | None = STDERR,
    log: LogTarget | None = None,
    combine: bool = True,
    start: int = 0,
    loss: bool = False,
) -> SpeedMeter | SpeedReported[P, R]:
    """Measure a training step's throughput: time per step, samples/s, tokens/s, TFLOP/s, MFU.

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from cudakit.speed import count_flops, speed_report
    >>> model = torch.nn.Linear(64, 64)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(32, 64), torch.randn(32, 64)
    >>> flops = count_flops(lambda x, y: F.mse_loss(model(x), y), x, y, model=model)
    >>> @speed_report(samples=len, flops=flops, every=2, log=print)
    ... def train_step(x, y):
    ...     loss = F.mse_loss(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     opt.zero_grad()
    >>> for _ in range(2):
    ...     train_step(x, y)  # doctest: +ELLIPSIS
    speed_report 'train_step' cpu step 2: ...s/step, ... samples/s,
    ...FLOP/s [last 2 steps]; ...
    >>> meter = train_step.speed_report
    >>> meter.steps, meter.total.samples, meter.total.flops == 2 * flops.total
    (2, 64.0, True)

    Each call of the decorated function (or each ``with meter:`` block) is timed
    and counted without reading anything from the device: on CUDA two events
    around the call, read only at the log interval or when a figure is read; on
    the CPU the wall clock. Calls are grouped into optimizer steps: by the
    ``autocast_step`` (``step=``, or the decorated function's own), whose windows
    are read from its position on the host; by the ``StepResult`` the function
    returns; by ``accumulate=N`` calls; or one call per step.

    Every ``every`` optimizer steps one line goes to stderr, like
    :func:`~cudakit.memory_report`'s: the rolling window of the last ``window``
    steps, then all steps so far. When a process group runs, that line carries
    every rank's figures combined (summed samples, tokens and FLOPs over the
    slowest rank's time, against the sum of the ranks' peaks): one small
    all-gather at the log step, which every rank reaches together. The figures
    are attributes too (:attr:`SpeedMeter.recent`, ``.total``, ``.mfu``...).

    The FLOPs of a call: ``flops=`` a function of the batch gives them exactly; a
    number is the same for every call; a :class:`~cudakit.speed.FlopCount` (from
    :func:`~cudakit.speed.count_flops` on an example batch) is scaled to each batch
    by its tokens when ``tokens=`` is given, else by its samples when ``samples=``
    is, else used as it is. MFU is achieved over peak FLOP/s: the dense peak of the
    GPU for the step's dtype from :data:`~cudakit.speed.PEAKS`, or ``peak_tflops=``.
    An unknown device, the CPU, or a missing FLOP count gives no MFU, and
    :attr:`SpeedMeter.mfu_reason` (and the line) says why.

    Args:
        label: a name for the line (a decorator's default: the function's name).
        samples: samples per call: a number, or a function of the batch (``len``).
        tokens: tokens per call: a number, or a function of the batch
            (``lambda b: b["attention_mask"].sum()``; a tensor is read later).
        flops: FLOPs per call: a ``FlopCount``, a number, or a function of the batch.
        accumulate: calls per optimizer step, when no ``autocast_step`` says it.
        step: the ``autocast_step`` (or its decorated function) whose windows are
            the optimizer steps; a decorated ``autocast_step`` function is found itself.
        dtype: what the step computes in, for the peak: a ``torch.dtype`` or ``"fp32"``,
            ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``. Default: the step's dtype, else
            float32 (TF32 when ``torch.set_float32_matmul_precision`` allows it).
        peak_tflops: the device's dense peak TFLOP/s, instead of the table's.
        device: the device the step runs on; default: the step's, else
            :func:`~cudakit.device.resolve_device`'s.
        every: write a line every ``every`` optimizer steps; ``None`` writes none
            (:meth:`SpeedMeter.flush` writes one on demand).
        window: optimizer steps in the rolling window.
        file: where the line goes; defaults to ``sys.stderr`` (or nowhere when
            ``log`` is given); ``None`` silences it.
        log: a ``logging.Logger`` (lines at INFO) or a callable taking the line.
        combine: combine the ranks' figures at each line when a process group runs.
        start: optimizer steps done before the meter's first call (a resumed run's
            position, ``ckpt.position.windows``): the line counts on from there, and
            the figures are those of the steps measured. A meter in a
            :class:`~cudakit.Checkpointer`'s ``extra=`` is given its count on a resume.
        loss: show the loss the decorated function returns (a ``StepResult``'s, or a
            one-element tensor) in the line, read when the line is written. Other
            values, and the ``with`` form's loss: :meth:`SpeedMeter.show`.

    Returns:
        The meter, a ``SpeedMeter`` (``with`` yields it), or the decorated function when
        used as bare ``@speed_report``.

    Raises:
        TypeError: an argument of the wrong kind.
        ValueError: a value out of range, both ``step=`` and ``accumulate=``, or a
            ``FlopCount`` to scale by samples or tokens its example has none of.
        DeviceError: a device this machine does not have, or the meta device.

    .. versionadded:: 0.1
    """
    name = label if isinstance(label, str) or label is None else None
    if label is not None and name is None and not callable(label):
        name = label  # settle() refuses it with the message
    settings = settle(
        name,
        samples=samples,
        tokens=tokens,
        flops=flops,
        accumulate=accumulate,
        step=step,
        dtype=dtype,
        peak_tflops=peak_tflops,
        device=device,
        every=every,
        window=window,
        file=file,
        log=log,
        combine=combine,
        start=start,
        loss=loss,
    )
    meter = SpeedMeter(settings)
    if callable(label):  # bare @speed_report
        return meter(label)
    return meter
