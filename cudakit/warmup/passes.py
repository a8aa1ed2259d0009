"""Warm-up passes of a training step that leave no trace: :func:`warmup`."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .._accel import synchronize
from ..device import DeviceLike, resolve_device
from ..exceptions import ReserveIgnoredWarning
from ._args import check_extra, check_model, check_optimizer
from ._reserve import ReserveSpec, parse_reserve, reserve_cuda
from .preserve import preserve_state
from .report import WarmupReport

_log = logging.getLogger("cudakit.warmup")

__all__ = ["warmup"]


def _resolve_amp(amp: object, device: torch.device) -> tuple[Callable[[], Any], tuple[Any, ...]]:
    """A factory of fresh autocast context managers for ``amp=``, and the state to preserve.

    An ``autocast_step`` object (or a function it decorated, via its ``.autocast_step``)
    is also returned for :class:`preserve_state`'s ``extra``, so a ``loss_fn`` that
    steps through it leaves its GradScaler and counters untouched.
    """
    if amp is None:
        return contextlib.nullcontext, ()
    amp = getattr(amp, "autocast_step", amp)
    factory = getattr(amp, "autocast", None)
    if callable(factory):
        stateful = callable(getattr(amp, "state_dict", None)) and callable(
            getattr(amp, "load_state_dict", None)
        )
        return factory, (amp,) if stateful else ()
    if isinstance(amp, torch.dtype):
        if amp == torch.float32:
            return contextlib.nullcontext, ()
        if not amp.is_floating_point:
            raise ValueError(
                f"amp={amp} is not a floating-point dtype. Use torch.bfloat16 or "
                "torch.float16, an autocast_step(...) object, or None for full precision."
            )
        return functools.partial(torch.autocast, device_type=device.type, dtype=amp), ()
    raise TypeError(
        f"amp= expects an autocast_step(...) object (anything with .autocast()), a "
        f"torch.dtype such as torch.bfloat16, or None; got {type(amp).__name__} {amp!r}."
    )


def _call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def _loss_of(out: Any, explicit: bool) -> torch.Tensor | None:
    """The scalar loss to backpropagate from a model or loss_fn output, if there is one.

    ``explicit``: the output is a loss by contract (``loss_fn``'s result, or a ``.loss``
    field), so a non-scalar tensor that requires grad is a mistake, not logits.
    """
    if not isinstance(out, torch.Tensor):
        out = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        explicit = True
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return None
    if out.ndim == 0:
        return out
    if explicit:
        raise ValueError(
            f"warmup() got a loss of shape {tuple(out.shape)} that requires grad; backward "
            "needs a scalar. Reduce it in loss_fn (e.g. `.mean()`), or run backward inside "
            "loss_fn and return None."
        )
    return None


def _infer_device(model: nn.Module | None, batch: Any) -> torch.device:
    if model is not None:
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        if first is not None:
            return first.device
    if isinstance(batch, torch.Tensor):
        return batch.device
    return resolve_device(None)


def warmup(
    model: nn.Module | None = None,
    example_batch: Any = None,
    *,
    loss_fn: Callable[[nn.Module, Any], Any] | nn.Module | None = None,
    steps: int = 2,
    optimizer: torch.optim.Optimizer | None = None,
    amp: Any = None,
    extra: Iterable[Any] = (),
    reserve: ReserveSpec = None,
    device: DeviceLike = None,
) -> WarmupReport:
    """Run warm-up passes of a training step, leave no trace, and report what they cost.

    Each of the ``steps`` passes runs the forward pass on ``example_batch`` under the
    autocast settings you train with, and backward when ``loss_fn`` is given or the
    model itself returns a scalar loss, so kernels get chosen (``cudnn.benchmark``
    autotuning included) and the caching allocator grows to what a real step needs.
    The passes run in the mode the model is in (call ``model.train()`` first).
    Afterwards everything :class:`preserve_state` covers is back bit for bit, also when
    a pass raises or is interrupted. No optimizer is stepped by ``warmup`` itself. On
    CUDA the peak-memory statistics are reset to measure the last pass
    (``torch.cuda.reset_peak_memory_stats``).

    >>> import torch
    >>> from cudakit.warmup import warmup
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    >>> before = {k: v.clone() for k, v in model.state_dict().items()}
    >>> report = warmup(model, torch.randn(16, 4), loss_fn=lambda m, x: m(x).square().mean())
    >>> report.steps, report.backward, len(report.pass_times)
    (2, True, 2)
    >>> all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    True

    Args:
        model: The module to warm up; ``None`` for a ``reserve``-only call.
        example_batch: One batch as your loop feeds it, already on the model's device.
            Without ``loss_fn`` the model is called as ``model(**batch)`` for a mapping,
            ``model(*batch)`` for a tuple, else ``model(batch)``.
        loss_fn: Either a loss module (``nn.CrossEntropyLoss()``, any ``nn.Module``),
            called as in a training loop, ``loss_fn(model(inputs), target)`` on
            ``example_batch=(inputs, target)``; or a function ``loss_fn(model, batch)``
            that runs your forward pass and returns the loss. The loss is
            backpropagated (a scalar tensor that requires grad, or an object with such a
            ``.loss``); if a function returns anything else (``None``, a detached loss)
            it is assumed to have run backward itself.
        steps: Number of passes, at least 1; the first is the slow one.
        optimizer: The optimizer, preserved too (needed when ``loss_fn`` steps it).
        amp: An ``autocast_step(...)`` object (anything whose ``.autocast()`` returns a
            context manager; its ``state_dict()`` is preserved too, if it has one) or a
            function it decorated, a ``torch.dtype`` for ``torch.autocast``, or ``None``
            (full precision).
        extra: Further objects with ``state_dict()``/``load_state_dict()`` that
            ``loss_fn`` changes (a scheduler, a GradScaler), preserved too.
        reserve: After the passes, make the CUDA caching allocator hold this much:
            bytes (``int`` or ``"12GiB"``) or a fraction of total device memory
            (``0.8`` or ``"80%"``). A no-op with :class:`ReserveIgnoredWarning` on
            devices other than CUDA.
        device: The device to report on and reserve on; default: the model's device,
            else the batch's, else :func:`~cudakit.device.resolve_device`'s choice.

    Returns:
        A :class:`WarmupReport` with per-pass times, peak memory of one step and the
        memory reserved after the call.

    Raises:
        TypeError: a wrong type for ``model``, ``optimizer``, ``amp``, ``extra``,
            ``steps`` or ``reserve``.
        ValueError: nothing to do, ``steps < 1``, a malformed ``reserve``, lazy
            parameters not yet materialized, or a loss that is not a scalar.
        MemoryReserveError: ``reserve`` asks for more memory than is free; nothing
            is allocated.

    .. versionadded:: 0.1
    """
    model = check_model(model, "warmup()")
    optimizer = check_optimizer(optimizer, "warmup()")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"warmup() expects steps to be an int >= 1, got {type(steps).__name__}.")
    if steps < 1:
        raise ValueError(f"warmup() expects steps >= 1, got {steps}. Two passes is typical.")
    if model is None and (example_batch is not None or loss_fn is not None):
        raise ValueError(
            "warmup() got an example batch or loss_fn but no model, so there is nothing to "
            "run it through. Call warmup(model, example_batch, loss_fn=...)."
        )
    if model is not None and example_batch is None and loss_fn is None:
        raise ValueError(
            "warmup(model) needs something to run: pass example_batch (one batch as your "
            "loop feeds it) and/or loss_fn=lambda model, batch: ... returning the loss."
        )
    if model is None and reserve is None:
        raise ValueError(
            "warmup() was given nothing to do. Pass a model and an example batch, e.g. "
            "warmup(model, batch, loss_fn=...), and/or reserve='80%'."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"warmup() expects loss_fn to be callable as loss_fn(model, batch), got "
            f"{type(loss_fn).__name__}."
        )
    # A loss *module* (nn.CrossEntropyLoss(), ...) is a criterion: criterion(model(x), y)
    # on a batch of (inputs, target), the way a training loop calls it.
    criterion = loss_fn if isinstance(loss_fn, nn.Module) and loss_fn is not model else None
    if criterion is not None and not (
        isinstance(example_batch, (tuple, list)) and len(example_batch) == 2
    ):
        raise TypeError(
            f"warmup() got the loss module {type(criterion).__name__} as loss_fn, so it calls "
            "loss_fn(model(inputs), target) and needs example_batch=(inputs, target); got "
            f"{type(example_batch).__name__}. Pass the batch as a 2-tuple, or a function "
            "loss_fn=lambda model, batch: ... returning the loss."
        )
    parsed = None if reserve is None else parse_reserve(reserve)
    dev = resolve_device(device) if device is not None else _infer_device(model, example_batch)
    autocast, amp_state = _resolve_amp(amp, dev)
    extra_items = check_extra(extra, "warmup()")

    times: list[float] = []
    backward = False
    peak: int | None = None
    if model is not None:
        with preserve_state(model, optimizer, extra=(*amp_state, *extra_items)):
            for i in range(steps):
                last_on_cuda = dev.type == "cuda" and i == steps - 1
                synchronize(dev)
                if last_on_cuda:
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                with autocast():
                    if criterion is not None:
                        inputs, target = example_batch
                        out = criterion(_call_model(model, inputs), target)
                    elif loss_fn is not None:
                        out = loss_fn(model, example_batch)
                    else:
                        out = _call_model(model, example_batch)
                loss = _loss_of(out, explicit=loss_fn is not None)
                if loss is not None:
                    loss.backward()
                    backward = True
                elif loss_fn is not None and torch.is_grad_enabled():
                    backward = True  # loss_fn ran backward itself
                del out, loss
                synchronize(dev)
                times.append(time.perf_counter() - t0)
                if last_on_cuda:
                    peak = torch.cuda.max_memory_allocated(dev)
        _log.debug("warm-up pass times on %s: %s", dev, times)

    requested: int | None = None
    if parsed is not None:
        if dev.type == "cuda":
            requested = reserve_cuda(reserve, parsed[0], parsed[1], dev)
        else:
            warnings.warn(
                f"warmup(reserve={reserve!r}) does nothing on {dev.type}: cudakit pre-fills "
                "only the CUDA caching allocator. Drop reserve= on this machine, or filter "
                "cudakit.warmup.ReserveIgnoredWarning.",
                ReserveIgnoredWarning,
                stacklevel=2,
            )
    reserved = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else None
    return WarmupReport(dev, len(times), backward, tuple(times), peak, reserved, requested)
