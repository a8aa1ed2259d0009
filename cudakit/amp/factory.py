"""The documented entry point: :func:`autocast_step` builds an :class:`AutocastStep`.

Its keyword signature is written out on purpose, so that the function users call is
typed and documented in one place; :class:`AutocastStep` takes the same keywords as
``**options`` (:class:`~cudakit.amp.step.StepOptions`) and hands them, unopened, to
the checks that read them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .spikes import SpikeRule
from .step import AutocastStep

__all__ = ["autocast_step"]


def autocast_step(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    model: torch.nn.Module | None = None,
    dtype: torch.dtype | str = "auto",
    enabled: bool = True,
    scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
    accumulate: int = 1,
    scheduler: Any = None,
    skip_nonfinite: bool = True,
    max_skipped: int | None = None,
    compile: bool | Mapping[str, Any] = False,
    skip_spikes: bool | str | SpikeRule | None = False,
    locate_nonfinite: bool = False,
) -> AutocastStep:
    """Build a mixed-precision training step: autocast, scaling, clipping, accumulation, guard.

    Decorate the function that computes the loss; each call then runs the forward
    under ``torch.autocast`` and backpropagates the (scaled, ``/accumulate``) loss.
    The first call of each window clears the gradients of the step's parameters
    first (as ``opt.zero_grad()`` before backward does). On every ``accumulate``-th
    call the step unscales, checks for inf/NaN, clips, steps every optimizer and
    scheduler. A step with a non-finite loss or gradient is skipped by all of them:
    the weights and the optimizer state are untouched.

    >>> import cudakit.amp as amp
    >>> model = torch.nn.Linear(8, 1)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> @amp.autocast_step(opt, max_grad_norm=1.0)
    ... def train_step(x, y):
    ...     return torch.nn.functional.mse_loss(model(x).float(), y)
    >>> result = train_step(torch.randn(16, 8), torch.randn(16, 1))
    >>> result.stepped, result.skipped, result.grad_norm is not None
    (True, False, True)

    Args:
        optimizer: the optimizer to step, or a list of them (e.g. Muon for matrices and
            AdamW for the rest). One backward, one clipping norm over all their
            parameters, one verdict: all step or all skip together; one GradScaler.
        model: the model being trained (optional). With DDP (``no_sync``) or FSDP2
            (``set_requires_gradient_sync``), micro-steps that do not step skip gradient
            communication, so gradients are reduced once per step; its buffers
            (BatchNorm statistics) are restored when a step is skipped.
        dtype: ``"auto"`` (CUDA: bf16 where native, else fp16; CPU: bf16 only where the
            CPU runs it natively, else float32), ``torch.bfloat16``, ``torch.float16``
            or ``torch.float32`` (autocast off). An explicit dtype is always honoured.
        enabled: False turns autocast and scaling off (a plain fp32 step).
        scaler: a ``torch.amp.GradScaler`` to use instead of a fresh one (fp16 only;
            with ``dtype="auto"`` it selects fp16).
        max_grad_norm: clip the total gradient norm to this, after unscaling, once per
            optimizer step; None turns clipping off.
        accumulate: number of calls whose gradients are summed per optimizer step;
            each loss is divided by it, unless the function returns
            ``{"loss": summed_loss, "weight": count}``: then the step uses the gradient
            of (all the window's summed losses over all ranks) / (all their weights).
        scheduler: an LR scheduler, or a list of them, stepped after every real (not
            skipped) optimizer step.
        skip_nonfinite: check the loss and gradients for inf/NaN (one fused kernel and
            one host read per optimizer step, none on micro-steps; with ``max_grad_norm``
            the clipping norm is what gets checked) and skip bad steps. fp16's scaler
            always skips non-finite gradients; False only drops the loss check there.
        max_skipped: raise :class:`~cudakit.exceptions.NonFiniteStepsError` after this
            many skipped optimizer steps in a row. Default 20 for fp16 (the scaler may
            skip a run of early steps while it finds its scale), 10 otherwise.
        compile: True (``torch.compile``'s defaults) or a dict of its options: the
            decorated function is compiled under autocast (its backward through
            AOTAutograd), and on a GPU's sync-free path with clipping also the check
            and the clipping (and, with ``skip_spikes`` in one process without a
            scaler, the spike test). The counters, the learning rate and the spike
            thresholds cause no recompiles.
            Applies to the decorated form; in the explicit form (``with step:`` and
            ``step.backward(loss)``) your code runs as written (compile the model
            yourself there), and the first ``backward()`` warns once.
        skip_spikes: skip a window whose loss (or gradient norm) is an outlier against
            the running mean and variance of the windows accepted before it, as a
            non-finite window is skipped, decided on the device. ``True`` (the default
            :class:`~cudakit.amp.SpikeRule`: the loss, 6 standard deviations, 20 windows
            of warm-up), ``"loss"``, ``"grad_norm"``, or a ``SpikeRule(...)``; False
            (default) turns it off. Needs ``skip_nonfinite=True``. Counted in
            ``StepResult.spike`` and ``spike_steps``, saved in ``state_dict()``.
        locate_nonfinite: when a window is skipped for an inf/NaN, replay its
            micro-batches' forward and backward with hooks and name the first module
            that produced one: a :class:`~cudakit.amp.NonFiniteWarning` and
            ``StepResult.nonfinite``. The replay changes nothing you own. It keeps a
            reference to each micro-batch's arguments until its window's verdict is
            read; nothing else runs until a window is skipped. Decorated step
            functions only (not ``step.backward(loss)``), not FSDP2.

    Returns:
        The step object, usable as ``@decorator`` or as ``with step:`` plus
        ``step.backward(loss)``, exposing ``dtype``, ``device_type``, ``enabled`` and
        ``autocast()``.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, or an option has the wrong type.
        ValueError: an option is out of range, the optimizer has no parameters, the
            device cannot run the requested dtype, or ``skip_spikes``/``locate_nonfinite``
            come with ``skip_nonfinite=False``.

    .. versionadded:: 0.1
    """
    return AutocastStep(
        optimizer,
        model=model,
        dtype=dtype,
        enabled=enabled,
        scaler=scaler,
        max_grad_norm=max_grad_norm,
        accumulate=accumulate,
        scheduler=scheduler,
        skip_nonfinite=skip_nonfinite,
        max_skipped=max_skipped,
        compile=compile,
        skip_spikes=skip_spikes,
        locate_nonfinite=locate_nonfinite,
    )
