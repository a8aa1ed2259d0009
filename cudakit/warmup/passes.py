"""Warm-up passes of a training step that leave no trace: :func:`warmup`.

:func:`warmup` first checks every argument and decides what each pass runs
(:func:`_plan`, no side effects), then carries the plan out (:func:`_run_passes`,
:func:`_reserve`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from .._accel import synchronize
from .._check import check_callable, check_device, check_extra, check_int, fail_type, fail_value
from ..device import DeviceLike, resolve_device
from ..exceptions import CompiledWarmupWarning, DeviceError, ReserveIgnoredWarning
from ..memory import memory_report
from ._args import check_model, check_optimizer
from ._loss import call_model, describe_forms, loss_form, loss_of
from .preserve import preserve_state
from .report import WarmupReport
from .reserve import ReserveSpec, parse_reserve, reserve_cuda

_log = logging.getLogger("cudakit.warmup")

__all__ = ["warmup"]

#: Dtypes ``torch.autocast`` lowers precision to.
AUTOCAST_DTYPES: Final = (torch.bfloat16, torch.float16)
#: Devices whose memory ``memory_report`` measures.
_MEASURED: Final = ("cuda", "cpu")


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
        # The step, and what it steps: its schedulers and optimizers (a loss_fn that runs
        # the whole step moves them too).
        owned = (amp, *getattr(amp, "schedulers", ()), *getattr(amp, "optimizers", ()))
        return factory, tuple(obj for obj in owned if _stateful(obj))
    if isinstance(amp, torch.dtype):
        if amp == torch.float32:
            return contextlib.nullcontext, ()
        fix = (
            "Use torch.bfloat16 or torch.float16, an autocast_step(...) object, or None "
            "(or torch.float32) for full precision."
        )
        if not amp.is_floating_point:
            fail_value(
                "warmup",
                "amp",
                "a floating-point autocast dtype",
                amp,
                f"{amp} is not a floating-point dtype. {fix}",
            )
        if amp not in AUTOCAST_DTYPES:
            fail_value(
                "warmup",
                "amp",
                "torch.bfloat16 or torch.float16",
                amp,
                f"torch.autocast runs in those two dtypes only, so {amp} would fail in the "
                f"first pass. {fix}",
            )
        return functools.partial(torch.autocast, device_type=device.type, dtype=amp), ()
    fail_type(
        "warmup",
        "amp",
        "an autocast_step(...) object (anything with .autocast()), a torch.dtype such as "
        "torch.bfloat16, or None",
        amp,
        "Pass amp=step (your autocast_step) or the dtype you train in, e.g. amp=torch.bfloat16.",
    )


def _stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _infer_device(model: nn.Module | None, batch: Any) -> torch.device:
    if model is not None:
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        if first is not None:
            return first.device
    if isinstance(batch, torch.Tensor):
        return batch.device
    return resolve_device(None)


def _check_batch(batch: object) -> None:
    """Refuse what is not one batch: an iterator, a generator or a loader."""
    if isinstance(batch, (Iterator, torch.utils.data.DataLoader)):
        fail_type(
            "warmup",
            "example_batch",
            "one batch (a tensor, or a tuple, list or dict of them)",
            batch,
            "Taking a batch from it here would consume it or advance the RNG. Take one with "
            "cudakit.warmup.example_batch(loader), which leaves the RNG as it was, and pass "
            "that.",
        )


def _check_not_meta(model: nn.Module) -> None:
    meta = [
        n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta
    ]
    if meta:
        raise DeviceError(
            f"warmup(model=...) got a model whose tensors are on the meta device "
            f"({', '.join(meta[:3])}): they have a shape but no data, so no pass can run. "
            "Materialize it first, e.g. model.to_empty(device='cuda') then load or "
            "initialize the weights, and call warmup again."
        )


def _check_plan_shape(
    model: nn.Module | None, batch: object, loss_fn: object, reserve: object
) -> None:
    """The cross-argument checks: is there something to do, and something to run it on."""
    if model is None and (batch is not None or loss_fn is not None):
        raise ValueError(
            "warmup() got an example batch or loss_fn but no model (model=None), so there is "
            "nothing to run it through: it needs the model. Call warmup(model, example_batch, "
            "loss_fn=...)."
        )
    if model is not None and batch is None and loss_fn is None:
        raise ValueError(
            "warmup(model) needs something to run: pass example_batch (one batch as your "
            "loop feeds it) and/or loss_fn=lambda model, batch: ... returning the loss."
        )
    if model is None and reserve is None:
        raise ValueError(
            "warmup() was given nothing to do. Pass a model and an example batch, e.g. "
            "warmup(model, batch, loss_fn=...), and/or reserve='80%'."
        )


@dataclass(frozen=True)
class _Plan:
    """What :func:`warmup` will do, decided from checked arguments."""

    model: nn.Module | None
    batch: Any
    loss_fn: Callable[..., Any] | None
    criterion: bool  # loss_fn(model(inputs), target) rather than loss_fn(model, batch)
    steps: int
    optimizer: torch.optim.Optimizer | None
    autocast: Callable[[], Any]
    preserve: tuple[Any, ...]
    reserve: ReserveSpec
    parsed_reserve: tuple[str, float] | None
    device: torch.device


def _is_compiled(model: nn.Module) -> bool:
    """True for a ``torch.compile``'d module (its ``OptimizedModule`` wrapper)."""
    return isinstance(getattr(model, "_orig_mod", None), nn.Module)


def _check_two_arguments(loss_fn: Callable[..., Any], criterion: bool) -> None:
    """Refuse a ``loss_fn`` that cannot take the two arguments warmup() will pass."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: find out by calling
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        form = "loss_fn(model(inputs), target)" if criterion else "loss_fn(model, batch)"
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise TypeError(
            f"warmup(loss_fn=...) is called as {form}, but {name}{signature} cannot take "
            f"two arguments ({exc}). Write it as lambda model, batch: ... returning the "
            f"loss, or as a criterion loss_fn(output, target). {describe_forms()}"
        ) from None


def _plan(
    model: object,
    batch: object,
    loss_fn: object,
    steps: object,
    optimizer: object,
    amp: object,
    extra: object,
    reserve: object,
    device: DeviceLike,
) -> _Plan:
    """Check every argument of :func:`warmup` and decide what it runs; changes nothing."""
    module = check_model(model, "warmup")
    opt = check_optimizer(optimizer, "warmup")
    steps = check_int(
        "warmup", "steps", steps, minimum=1, fix="Two passes is typical: steps=2."
    )  # a NumPy int too
    _check_plan_shape(module, batch, loss_fn, reserve)
    _check_batch(batch)
    if module is not None:
        _check_not_meta(module)
    if loss_fn is not None:
        loss_fn = check_callable(
            "warmup",
            "loss_fn",
            loss_fn,
            expected="a function called as loss_fn(model, batch) or loss_fn(model(inputs), target)",
            fix=describe_forms(),
        )
    criterion = loss_fn is not None and loss_form(loss_fn, module) == "criterion"
    if loss_fn is not None:
        _check_two_arguments(loss_fn, criterion)
    if criterion and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        kind = "loss module" if isinstance(loss_fn, nn.Module) else "criterion"
        name = (
            type(loss_fn).__name__
            if isinstance(loss_fn, nn.Module)
            else getattr(loss_fn, "__name__", repr(loss_fn))
        )
        raise TypeError(
            f"warmup() got the {kind} {name} as loss_fn, so it calls "
            "loss_fn(model(inputs), target) and needs example_batch=(inputs, target); got "
            f"{type(batch).__name__}. Pass the batch as a 2-tuple, or a function "
            "loss_fn=lambda model, batch: ... returning the loss."
        )
    parsed = None if reserve is None else parse_reserve(reserve)
    dev = (
        check_device("warmup", "device", device, resolve_device)
        if device is not None
        else _infer_device(module, batch)
    )
    if dev.type == "meta":
        raise DeviceError(
            f"warmup(device={device!r}): the meta device holds no data, so nothing can run "
            "or be measured there. Pass the device the model trains on (or leave device= "
            "out to use the model's)."
        )
    autocast, amp_state = _resolve_amp(amp, dev)
    extra_items = check_extra("warmup", extra)
    return _Plan(
        module,
        batch,
        loss_fn,
        criterion,
        steps,
        opt,
        autocast,
        (*amp_state, *extra_items),
        reserve,  # type: ignore[arg-type]
        parsed,
        dev,
    )


def _one_pass(plan: _Plan, model: nn.Module) -> Any:
    """The forward pass (and loss) of one warm-up pass, under the plan's autocast."""
    with plan.autocast():
        if plan.loss_fn is None:
            return call_model(model, plan.batch)
        if plan.criterion:
            inputs, target = plan.batch
            args: tuple[Any, Any] = (call_model(model, inputs), target)
            form = "loss_fn(model(inputs), target)"
        else:
            args, form = (model, plan.batch), "loss_fn(model, batch)"
        try:
            return plan.loss_fn(*args)
        except (TypeError, AttributeError) as exc:
            exc.add_note(f"cudakit: {describe_forms()} This one was called as {form}.")
            raise


def _run_passes(plan: _Plan, model: nn.Module) -> tuple[list[float], bool, int | None]:
    """Run the passes inside preserve_state; (seconds per pass, backward ran, peak bytes)."""
    dev = plan.device
    times: list[float] = []
    backward = False
    peak: int | None = None
    with preserve_state(model, plan.optimizer, extra=plan.preserve):
        for i in range(plan.steps):
            measure = i == plan.steps - 1 and dev.type in _MEASURED
            synchronize(dev)
            with (
                memory_report(device=dev, file=None) if measure else contextlib.nullcontext()
            ) as rep:
                t0 = time.perf_counter()
                out = _one_pass(plan, model)
                loss = loss_of(out, explicit=plan.loss_fn is not None)
                if loss is not None:
                    loss.backward()
                    backward = True
                elif plan.loss_fn is not None and torch.is_grad_enabled():
                    backward = True  # loss_fn ran backward itself
                del out, loss
                synchronize(dev)
                times.append(time.perf_counter() - t0)
            if rep is not None:
                peak = rep.peak_allocated
    _log.debug("warm-up pass times on %s: %s", dev, times)
    return times, backward, peak


def _reserve(plan: _Plan) -> int | None:
    """Carry out ``reserve=``: the bytes asked for on CUDA, a warning elsewhere."""
    if plan.parsed_reserve is None:
        return None
    dev = plan.device
    if dev.type == "cuda":
        kind, value = plan.parsed_reserve
        return reserve_cuda(plan.reserve, kind, value, dev)
    warnings.warn(
        f"warmup(reserve={plan.reserve!r}) does nothing on {dev.type}: cudakit pre-fills "
        "only the CUDA caching allocator. Drop reserve= on this machine, or filter "
        "cudakit.warmup.ReserveIgnoredWarning.",
        ReserveIgnoredWarning,
        stacklevel=3,
    )
    return None


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
    a pass raises or is interrupted. No optimizer is stepped by ``warmup`` itself. The
    last pass runs inside ``memory_report(device=...)``, so its peak is measured the
    same way (CUDA allocator on a GPU, resident memory on the CPU) and nests safely in
    your own reports. Every argument is checked before anything runs; a refused call
    changes nothing.

    >>> import torch
    >>> from cudakit.warmup import warmup
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    >>> before = {k: v.clone() for k, v in model.state_dict().items()}
    >>> report = warmup(
    ...     model, torch.randn(16, 4), loss_fn=lambda m, x: m(x).square().mean()
    ... )
    >>> report.steps, report.backward, len(report.pass_times)
    (2, True, 2)
    >>> all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    True

    Args:
        model: The module to warm up; ``None`` for a ``reserve``-only call.
        example_batch: One batch as your loop feeds it, already on the model's device
            (take it from a loader with :func:`example_batch`, which leaves the RNG as
            it was). Without ``loss_fn`` the model is called as ``model(**batch)`` for
            a mapping, ``model(*batch)`` for a tuple, else ``model(batch)``.
        loss_fn: Either a criterion, called as in a training loop,
            ``loss_fn(model(inputs), target)`` on ``example_batch=(inputs, target)``:
            a loss module (``nn.CrossEntropyLoss()``, any ``nn.Module`` but the model),
            a ``torch.nn.functional`` loss (``F.nll_loss``), or a function whose first
            parameter is annotated ``torch.Tensor`` or named ``input``, ``output``,
            ``out``, ``logits``, ``pred`` (and the like); or a step function
            ``loss_fn(model, batch)`` (every other callable) that runs your forward
            pass and returns the loss. The loss is
            backpropagated (a scalar tensor that requires grad, or an object with such a
            ``.loss``); if a function returns anything else (``None``, a detached loss)
            it is assumed to have run backward itself.
        steps: Number of passes, at least 1; the first is the slow one.
        optimizer: The optimizer, preserved too (needed when ``loss_fn`` steps it).
        amp: An ``autocast_step(...)`` object (anything whose ``.autocast()`` returns a
            context manager; its ``state_dict()`` is preserved too, if it has one) or a
            function it decorated, ``torch.bfloat16`` or ``torch.float16`` for
            ``torch.autocast``, or ``None``/``torch.float32`` (full precision).
        extra: Further objects with ``state_dict()``/``load_state_dict()`` that
            ``loss_fn`` changes (a scheduler, a GradScaler), tensors and
            ``torch.Generator`` objects, preserved too.
        reserve: After the passes, make the CUDA caching allocator hold this much:
            bytes (``int`` or ``"12GiB"``) or a fraction of total device memory
            (``0.8`` or ``"80%"``). A no-op with :class:`ReserveIgnoredWarning` on
            devices other than CUDA.
        device: The device to report on and reserve on; default: the model's device,
            else the batch's, else :func:`~cudakit.device.resolve_device`'s choice.

    Returns:
        A ``WarmupReport`` with per-pass times, peak memory of one step and the
        memory reserved after the call.

    Raises:
        TypeError: a wrong type for ``model``, ``optimizer``, ``amp``, ``extra``,
            ``steps`` or ``reserve``; an iterator or loader as ``example_batch``; a
            criterion without an ``(inputs, target)`` batch.
        ValueError: nothing to do, ``steps < 1``, a malformed ``reserve``, an ``amp``
            dtype autocast cannot run in, lazy parameters not yet materialized, or a
            loss that is not a scalar.
        DeviceError: a model on the meta device (no data to run on), or a ``device``
            this machine does not have.
        MemoryReserveError: ``reserve`` asks for more memory than is free; nothing
            is allocated.

    Warns:
        CompiledWarmupWarning: a ``torch.compile``'d model without ``amp=``: the
            passes would compile the float32 graph, and training under autocast would
            compile again.

    .. versionadded:: 0.1
    """
    plan = _plan(model, example_batch, loss_fn, steps, optimizer, amp, extra, reserve, device)
    if amp is None and plan.model is not None and _is_compiled(plan.model):
        warnings.warn(
            "warmup() got a torch.compile'd model and no amp=, so it compiles the float32 "
            'graph; a training step under autocast then recompiles it ("GLOBAL_STATE '
            'changed: autocast"). Pass amp=step (your autocast_step) or the dtype you train '
            "in, e.g. amp=torch.bfloat16, so warm-up compiles the graph training runs; "
            "amp=torch.float32 says float32 training is meant.",
            CompiledWarmupWarning,
            stacklevel=2,
        )
    times: list[float] = []
    backward = False
    peak: int | None = None
    if plan.model is not None:
        times, backward, peak = _run_passes(plan, plan.model)
    requested = _reserve(plan)
    dev = plan.device
    reserved = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else None
    return WarmupReport(dev, len(times), backward, tuple(times), peak, reserved, requested)
