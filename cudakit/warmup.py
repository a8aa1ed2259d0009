"""Warm-up passes that leave no trace, memory reservation, and batch-size search.

The first steps of a CUDA run are slow: the context starts, cuBLAS/cuDNN create
their handles, ``cudnn.benchmark`` autotunes, and the caching allocator grows one
``cudaMalloc`` at a time. :func:`warmup` pays those costs up front on an example
batch and then puts every piece of training state back exactly as it was;
:func:`find_batch_size` finds the largest batch that fits in memory.

Public names:

* :func:`warmup` runs forward/backward passes and returns a :class:`WarmupReport`;
  its ``reserve=`` pre-allocates memory in the CUDA caching allocator.
* :class:`preserve_state` is the no-trace guarantee on its own, as ``with`` or ``@``.
* :func:`warmed` wraps a step function so that its first call is preceded by
  warm-up calls that leave no trace.
* :func:`find_batch_size` grows the batch size geometrically, then bisects;
  :func:`is_oom_error` is the out-of-memory test it uses.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import itertools
import logging
import math
import random
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Concatenate, Protocol, TypeVar, overload

import torch
from torch import nn
from typing_extensions import ParamSpec, Self

from ._contextlib import ContextDecorator, reject_deferred_body
from ._oom import is_oom_error
from ._units import format_bytes
from .device import DeviceLike, resolve_device
from .exceptions import BatchSizeSearchError, MemoryReserveError, ReserveIgnoredWarning

__all__ = [
    "MemoryReserveError",
    "ReserveIgnoredWarning",
    "WarmupReport",
    "find_batch_size",
    "is_oom_error",
    "preserve_state",
    "warmed",
    "warmup",
]

P = ParamSpec("P")
R = TypeVar("R")

_log = logging.getLogger(__name__)

ReserveSpec = int | float | str | None


# --------------------------------------------------------------------------- no trace


def _clone_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _restore_value(original: Any, saved: Any) -> Any:
    """Put ``saved`` back into ``original`` in place when it is a tensor; return the object."""
    if isinstance(original, torch.Tensor) and isinstance(saved, torch.Tensor):
        if (original.shape, original.dtype, original.device) == (
            saved.shape,
            saved.dtype,
            saved.device,
        ):
            original.copy_(saved)
        else:
            original.data = saved
        return original
    return saved


def _restore_dict(target: dict[Any, Any], saved: dict[Any, Any]) -> None:
    """Make ``target`` hold exactly the items of ``saved`` (same objects), in place."""
    for key in [k for k in target if k not in saved]:
        del target[key]
    for key, value in saved.items():
        if key not in target or target[key] is not value:
            target[key] = value


class _Snapshot:
    """Everything a training step can change, saved so it can be put back bit for bit."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        extra: tuple[Any, ...],
    ) -> None:
        modules = list(model.modules()) if model is not None else []
        with torch.no_grad():
            # Attribute dicts (shallow: which object sits under which name, `training` too),
            # and the parameter, buffer and submodule slots of every submodule.
            self.modules = [
                (m, dict(vars(m)), [(d, dict(d)) for d in (m._parameters, m._buffers, m._modules)])
                for m in modules
            ]
            seen: set[int] = set()
            tensors: list[torch.Tensor] = []

            def add(t: torch.Tensor | None) -> None:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)

            for m in modules:
                for param in m._parameters.values():
                    add(param)
                for buf in m._buffers.values():
                    add(buf)
            if optimizer is not None:
                for group in optimizer.param_groups:
                    for t in group["params"]:
                        add(t)
            self.tensors = [
                (
                    t,
                    t.detach().clone(),
                    t.requires_grad,
                    t.grad,
                    None if t.grad is None else t.grad.detach().clone(),
                )
                for t in tensors
            ]
            self.optimizer = optimizer
            if optimizer is not None:
                # vars() holds the `state` and `param_groups` objects themselves.
                self.opt_vars = dict(vars(optimizer))
                self.opt_state = {
                    p: (s, {k: (v, _clone_value(v)) for k, v in s.items()})
                    for p, s in optimizer.state.items()
                }
                self.opt_groups = [
                    (
                        g,
                        g["params"],
                        list(g["params"]),
                        {k: (v, _clone_value(v)) for k, v in g.items() if k != "params"},
                    )
                    for g in optimizer.param_groups
                ]
            self.extra = [(obj, copy.deepcopy(obj.state_dict())) for obj in extra]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_was_initialized = torch.cuda.is_initialized()
        self.cuda_rng = torch.cuda.get_rng_state_all() if self.cuda_was_initialized else None
        self.py_rng = random.getstate()
        np = sys.modules.get("numpy")
        self.np_rng = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        with torch.no_grad():
            # Extras first: their load_state_dict() may set tensors (AutocastStep rebinds
            # .grad mid-window) that the exact restore below must have the last word on.
            for obj, state in self.extra:
                obj.load_state_dict(state)
            for m, attrs, slots in self.modules:
                _restore_dict(vars(m), attrs)
                for target, saved_slots in slots:
                    _restore_dict(target, saved_slots)
            for t, data, requires_grad, grad, grad_data in self.tensors:
                _restore_value(t, data)
                if t.requires_grad != requires_grad:
                    t.requires_grad_(requires_grad)
                if grad is not None and grad_data is not None:
                    _restore_value(grad, grad_data)
                if t.grad is not grad:
                    t.grad = grad
            opt = self.optimizer
            if opt is not None:
                _restore_dict(vars(opt), self.opt_vars)
                _restore_dict(opt.state, {p: s for p, (s, _) in self.opt_state.items()})
                for s, items in self.opt_state.values():
                    _restore_dict(s, {k: _restore_value(v, c) for k, (v, c) in items.items()})
                opt.param_groups[:] = [g for g, *_ in self.opt_groups]
                for g, params_obj, group_params, items in self.opt_groups:
                    params_obj[:] = group_params
                    saved: dict[str, Any] = {k: _restore_value(v, c) for k, (v, c) in items.items()}
                    saved["params"] = params_obj
                    _restore_dict(g, saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        elif torch.cuda.is_initialized():
            # CUDA started during the block: reset its generators to their fresh state.
            torch.cuda.manual_seed_all(torch.cuda.initial_seed())
        random.setstate(self.py_rng)
        np = sys.modules.get("numpy")
        if np is not None and self.np_rng is not None:
            np.random.set_state(self.np_rng)


def _check_model(model: object, where: str) -> nn.Module | None:
    if model is None:
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where} expects model to be a torch.nn.Module, got {type(model).__name__}. "
            "Pass the module itself (not its state_dict or parameters())."
        )
    lazy = [n for n, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ValueError(
            f"{where} got a model with uninitialized lazy parameters ({', '.join(lazy[:3])}); "
            "a warm-up pass would materialize them and that cannot be undone. Run one "
            "forward pass first, e.g. `model(example_input)`, then call it again."
        )
    return model


def _check_optimizer(optimizer: object, where: str) -> torch.optim.Optimizer | None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(
        f"{where} expects optimizer to be a torch.optim.Optimizer or None, got "
        f"{type(optimizer).__name__}. Pass the optimizer object; put schedulers and "
        "GradScalers in extra=(...)."
    )


def _check_extra(extra: object, where: str) -> tuple[Any, ...]:
    if not isinstance(extra, Iterable) or isinstance(extra, (str, bytes)):
        raise TypeError(
            f"{where} expects extra to be a tuple of objects with state_dict() and "
            f"load_state_dict(), got {type(extra).__name__}. For one object write extra=(obj,)."
        )
    items = tuple(extra)
    for obj in items:
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{where} can only preserve extra objects that have state_dict() and "
                f"load_state_dict(); {type(obj).__name__} has not. Preserve it yourself or "
                "leave it out."
            )
    return items


class preserve_state(ContextDecorator):
    """Put a model, its optimizer and the random number generators back exactly as they were.

    On exit, normal or by any exception (``KeyboardInterrupt`` included), restores bit
    for bit: parameters and buffers (BatchNorm running statistics and
    ``num_batches_tracked`` too), ``.grad`` (its ``None``-ness, the very tensor object,
    and its values), ``requires_grad`` flags, every submodule's ``training`` mode and
    other attributes, the optimizer's state and ``param_groups`` (tensors restored in
    place), ``state_dict()`` of every object in ``extra`` (schedulers, GradScalers,
    :class:`~cudakit.amp.AutocastStep`), and the CPU, CUDA, ``random`` and NumPy RNG
    states. Tensors are cloned on their own device and copied back with ``copy_``, so
    the block needs spare memory the size of that state.

    >>> import torch
    >>> from cudakit.warmup import preserve_state
    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> w = model.weight.clone()
    >>> with preserve_state(model, opt):
    ...     model(torch.ones(1, 2)).sum().backward()
    ...     opt.step()
    >>> torch.equal(model.weight, w), model.weight.grad is None
    (True, True)

    Args:
        model: The module to preserve, or ``None``.
        optimizer: Its optimizer, or ``None``; its parameters are preserved too.
        extra: Further objects with ``state_dict()``/``load_state_dict()``.

    Raises:
        TypeError: ``model`` is not a module, ``optimizer`` not an optimizer, or an
            ``extra`` object has no ``state_dict``/``load_state_dict``.
        ValueError: the model still has uninitialized lazy parameters.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: Iterable[Any] = (),
    ) -> None:
        self.model = _check_model(model, "preserve_state()")
        self.optimizer = _check_optimizer(optimizer, "preserve_state()")
        self.extra = _check_extra(extra, "preserve_state()")
        self._snapshots: list[_Snapshot] = []

    def clone(self) -> Self:
        """Return a fresh, un-entered copy guarding the same objects."""
        return type(self)(self.model, self.optimizer, extra=self.extra)

    def __enter__(self) -> Self:
        self._snapshots.append(_Snapshot(self.model, self.optimizer, self.extra))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._snapshots.pop().restore()


# --------------------------------------------------------------------------- warmup


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warmup` measured.

    Times are wall-clock seconds per pass (CUDA synchronised around each pass);
    memory figures are bytes, ``None`` where not measured (on CPU, or without passes).

    >>> from cudakit.warmup import WarmupReport
    >>> r = WarmupReport(torch.device("cpu"), 2, True, (0.5, 0.1), None, None, None)
    >>> round(r.speedup, 1), r.first_pass_s, r.last_pass_s
    (5.0, 0.5, 0.1)

    Attributes:
        device: The device warmed up.
        steps: Number of passes run.
        backward: Whether the passes ran backward too.
        pass_times: Seconds of each pass, in order.
        peak_allocated: CUDA: peak bytes allocated during the last pass (the memory one
            step needs, weights included); ``None`` on other devices.
        reserved_after: CUDA: bytes held by the caching allocator after the call.
        reserve_requested: Bytes ``reserve=`` asked the allocator to hold, if given.

    .. versionadded:: 0.1
    """

    device: torch.device
    steps: int
    backward: bool
    pass_times: tuple[float, ...]
    peak_allocated: int | None
    reserved_after: int | None
    reserve_requested: int | None

    @property
    def first_pass_s(self) -> float | None:
        """Seconds of the first pass, ``None`` without passes."""
        return self.pass_times[0] if self.pass_times else None

    @property
    def last_pass_s(self) -> float | None:
        """Seconds of the last pass, ``None`` without passes."""
        return self.pass_times[-1] if self.pass_times else None

    @property
    def speedup(self) -> float | None:
        """First-pass time over last-pass time: the warm-up effect."""
        if not self.pass_times or self.pass_times[-1] <= 0:
            return None
        return self.pass_times[0] / self.pass_times[-1]

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable dict of the report."""
        return {
            "device": str(self.device),
            "steps": self.steps,
            "backward": self.backward,
            "pass_times": list(self.pass_times),
            "first_pass_s": self.first_pass_s,
            "last_pass_s": self.last_pass_s,
            "speedup": self.speedup,
            "peak_allocated": self.peak_allocated,
            "reserved_after": self.reserved_after,
            "reserve_requested": self.reserve_requested,
        }

    def __str__(self) -> str:
        kind = "forward+backward" if self.backward else "forward"
        lines = [f"warmup on {self.device}: {self.steps} {kind} pass(es)"]
        if self.pass_times:
            lines.append(
                f"  first pass {self.pass_times[0] * 1e3:.2f} ms, last pass "
                f"{self.pass_times[-1] * 1e3:.2f} ms (x{self.speedup or float('nan'):.1f})"
            )
        na = "not measured on " + self.device.type
        peak = format_bytes(self.peak_allocated) if self.peak_allocated is not None else na
        lines.append(f"  peak allocated in one step: {peak}")
        reserved = format_bytes(self.reserved_after) if self.reserved_after is not None else na
        lines.append(f"  reserved by the caching allocator after: {reserved}")
        return "\n".join(lines)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*|%)\s*$")


def _parse_reserve(spec: object) -> tuple[str, float]:
    """``("fraction", f)`` or ``("bytes", n)`` for a ``reserve=`` value; raise on nonsense."""
    fix = (
        'Pass bytes (an int, or a string like "12GiB"), a fraction of total device memory '
        '(a float in (0, 1], or a string like "80%"), or None.'
    )
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"reserve= got {type(spec).__name__} {spec!r}. {fix}")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"reserve={spec} bytes must be positive. {fix}")
        return "bytes", float(spec)
    if isinstance(spec, float):
        if not 0.0 < spec <= 1.0:
            raise ValueError(
                f"reserve={spec} is read as a fraction of total device memory and must be in "
                f"(0, 1]. {fix}"
            )
        return "fraction", spec
    m = _SIZE_RE.match(spec)
    unit = m.group(2).lower() if m else ""
    if m is None or (unit != "%" and unit not in _UNITS):
        raise ValueError(f"reserve={spec!r} is not a size cudakit understands. {fix}")
    value = float(m.group(1))
    if unit == "%":
        if not 0.0 < value <= 100.0:
            raise ValueError(f"reserve={spec!r} must be a percentage in (0, 100]. {fix}")
        return "fraction", value / 100.0
    if value * _UNITS[unit] < 1:
        raise ValueError(f"reserve={spec!r} asks for no memory. {fix}")
    return "bytes", value * _UNITS[unit]


def _reserve_cuda(spec: ReserveSpec, kind: str, value: float, device: torch.device) -> int:
    """Make the caching allocator hold at least the requested bytes; return that target."""
    total = torch.cuda.get_device_properties(device).total_memory
    target = int(value * total) if kind == "fraction" else int(value)
    if target > total:
        raise MemoryReserveError(
            f"reserve={spec!r} asks for {format_bytes(target)}, more than {device} has in total "
            f"({format_bytes(total)}). Nothing was allocated. Ask for less, e.g. reserve='80%'."
        )
    held = torch.cuda.memory_reserved(device)
    need = target - held
    if need <= 0:
        return target
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        possible = (held + free) / total * 100
        raise MemoryReserveError(
            f"reserve={spec!r} asks the caching allocator to hold {format_bytes(target)} on "
            f"{device}; it holds {format_bytes(held)} and the device has only {format_bytes(free)} "
            f"free of {format_bytes(total)} (the CUDA context and other processes use the rest). "
            f"Nothing was allocated. Ask for at most about reserve='{math.floor(possible)}%'."
        )
    # One allocation of `need` bytes may be served from blocks the cache already holds
    # free, growing nothing; so hold each block until the reservation reaches the target
    # (every round either grows it or uses up cached free memory), then free them all.
    blocks: list[torch.Tensor] = []
    try:
        with torch.cuda.device(device):
            while need > 0:
                blocks.append(torch.empty(need, dtype=torch.uint8, device=device))
                need = target - torch.cuda.memory_reserved(device)
        blocks.clear()  # back to the cache, not to the driver
    except Exception as exc:
        blocks.clear()
        if not is_oom_error(exc):
            raise
        raise MemoryReserveError(
            f"reserve={spec!r}: {format_bytes(target - held)} looked free on {device} but "
            "could not be allocated (another process took it, or the address space is "
            "fragmented); the allocator released its free cache while trying. Ask for less."
        ) from None
    return target


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    model = _check_model(model, "warmup()")
    optimizer = _check_optimizer(optimizer, "warmup()")
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
    parsed = None if reserve is None else _parse_reserve(reserve)
    dev = resolve_device(device) if device is not None else _infer_device(model, example_batch)
    autocast, amp_state = _resolve_amp(amp, dev)
    extra_items = _check_extra(extra, "warmup()")

    times: list[float] = []
    backward = False
    peak: int | None = None
    if model is not None:
        with preserve_state(model, optimizer, extra=(*amp_state, *extra_items)):
            for i in range(steps):
                last_on_cuda = dev.type == "cuda" and i == steps - 1
                _sync(dev)
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
                _sync(dev)
                times.append(time.perf_counter() - t0)
                if last_on_cuda:
                    peak = torch.cuda.max_memory_allocated(dev)
        _log.debug("warm-up pass times on %s: %s", dev, times)

    requested: int | None = None
    if parsed is not None:
        if dev.type == "cuda":
            requested = _reserve_cuda(reserve, parsed[0], parsed[1], dev)
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


# --------------------------------------------------------------------------- warmed


class _WarmedDecorator(Protocol):
    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def warmed(
    fn: Callable[P, R],
    /,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: Iterable[Any] = ...,
    steps: int = ...,
) -> Callable[P, R]: ...
@overload
def warmed(
    fn: None = None,
    /,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: Iterable[Any] = ...,
    steps: int = ...,
) -> _WarmedDecorator: ...
def warmed(
    fn: Callable[P, R] | None = None,
    /,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Iterable[Any] = (),
    steps: int = 1,
) -> Callable[P, R] | _WarmedDecorator:
    """Wrap a step function so its first call is preceded by warm-up calls that leave no trace.

    On the first call, ``fn(*args, **kwargs)`` runs ``steps`` times inside
    :class:`preserve_state` for ``model``, ``optimizer`` and ``extra``; then the real
    call runs and its result is returned. Later calls go straight to ``fn``. The
    promise covers what you pass: anything else the step changes (a global step
    counter, a logger, data pulled from an iterator) is not rolled back, so put
    schedulers, GradScalers and ``autocast_step`` objects in ``extra``.

    >>> import copy, torch
    >>> from cudakit.warmup import warmed
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> twin = copy.deepcopy(model)
    >>> calls = []
    >>> @warmed(model=model, optimizer=opt, steps=2)
    ... def step(m, x):
    ...     calls.append(x)
    ...     opt.zero_grad()
    ...     m(x).square().mean().backward()
    ...     opt.step()
    >>> step(model, torch.ones(4, 2))           # 2 warm-up calls, rolled back, then the real one
    >>> len(calls)
    3
    >>> twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    >>> twin(torch.ones(4, 2)).square().mean().backward()
    >>> twin_opt.step()
    >>> torch.equal(model.weight, twin.weight)   # exactly one step happened
    True

    Args:
        fn: The step function; omit it to use ``@warmed(model=...)`` as a decorator.
        model: The module the step trains.
        optimizer: Its optimizer, if the step steps one.
        extra: Further objects with ``state_dict()``/``load_state_dict()`` to roll back.
        steps: Number of warm-up calls before the first real one, at least 1.

    Returns:
        The wrapped function (same signature), or a decorator producing it.

    Raises:
        TypeError: ``fn`` is not callable or is a generator/coroutine function, or a
            wrong type for the other arguments.
        ValueError: ``steps < 1``.

    .. versionadded:: 0.1
    """
    guard = preserve_state(model, optimizer, extra=extra)
    if guard.model is None:
        raise TypeError(
            "warmed() needs model=, the module the step function trains, so that the warm-up "
            "calls can be rolled back. Write @warmed(model=model, optimizer=optimizer)."
        )
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(
            f"warmed() expects steps to be an int >= 1, got {type(steps).__name__} {steps!r}."
        )
    if steps < 1:
        raise ValueError(f"warmed() expects steps to be an int >= 1, got {steps!r}.")

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        if not callable(func):
            raise TypeError(
                f"warmed() wraps a step function, got {type(func).__name__}. Use "
                "@warmed(model=model, optimizer=optimizer) above a `def`."
            )
        reject_deferred_body(
            func, "warmed() cannot wrap", "Wrap a plain step function.", ", outside the rollback"
        )
        lock = threading.Lock()
        done = False

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            nonlocal done
            if not done:
                with lock:
                    if not done:
                        with guard.clone():
                            for _ in range(steps):
                                func(*args, **kwargs)
                        done = True
            return func(*args, **kwargs)

        return wrapper

    if fn is None:
        return decorate  # type: ignore[return-value]
    return decorate(fn)


# --------------------------------------------------------------------------- batch size


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"find_batch_size() expects {name} to be an int, got {type(value).__name__} {value!r}."
        )
    if value < 1:
        raise ValueError(f"find_batch_size() expects {name} >= 1, got {value}.")
    return value


@dataclass(frozen=True)
class _Search:
    start: int
    lower: int
    upper: int | None
    multiple_of: int
    margin: float

    @classmethod
    def checked(
        cls, start: object, lower: object, upper: object, multiple_of: object, margin: object
    ) -> _Search:
        s = _positive_int("start", start)
        lo = _positive_int("lower", lower)
        hi = None if upper is None else _positive_int("upper", upper)
        m = _positive_int("multiple_of", multiple_of)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise TypeError(
                f"find_batch_size() expects margin to be a float in [0, 1), got "
                f"{type(margin).__name__} {margin!r}."
            )
        if not 0.0 <= margin < 1.0:
            raise ValueError(
                f"find_batch_size() expects margin in [0, 1) (the fraction to back off from "
                f"the largest size that fits, e.g. 0.1), got {margin}."
            )
        if hi is not None and hi < lo:
            raise ValueError(
                f"find_batch_size() got upper={hi} below lower={lo}; swap them or widen the range."
            )
        first = -(-lo // m) * m
        if hi is not None and first > hi:
            raise ValueError(
                f"find_batch_size() found no multiple of {m} between lower={lo} and upper={hi}. "
                f"Widen the range or use a smaller multiple_of."
            )
        return cls(s, lo, hi, m, float(margin))

    def run(self, trial: Callable[[int], R]) -> tuple[int, R | None]:
        """Search; return (largest fitting size, the trial's result there).

        Sizes are counted in units of ``multiple_of``. Every success is above the
        previous best and every failure below the previous first failure, so one
        attempt() updates both ends of the bracket.
        """
        m = self.multiple_of
        lo = -(-self.lower // m)
        hi = None if self.upper is None else self.upper // m
        k = max(lo, self.start // m)
        if hi is not None:
            k = min(k, hi)
        tried: list[int] = []
        best: int | None = None  # largest size that fit
        best_result: R | None = None
        fail: int | None = None  # smallest size that did not
        last_oom = ""

        def attempt(k: int) -> bool:
            nonlocal best, best_result, fail, last_oom
            try:
                result = trial(k * m)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                last_oom = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                fail = k
            else:
                best, best_result = k, result
                del result
            _free_memory()  # outside `except`: the traceback and its tensors are gone
            tried.append(k * m)
            _log.debug("find_batch_size: %d %s", k * m, "fits" if best == k else "out of memory")
            return best == k

        if attempt(k):  # grow geometrically up to the first failure (or upper)
            while (hi is None or k < hi) and attempt(k := 2 * k if hi is None else min(2 * k, hi)):
                if hi is None and k * m >= _GROWTH_LIMIT:
                    raise BatchSizeSearchError(
                        f"find_batch_size(): the trial still fits at batch size {k * m} "
                        f"(tried {', '.join(map(str, tried))}), so it does not seem to use its "
                        "batch size (or never runs out of memory). Check that trial_fn builds "
                        "a batch of the size it is given, or set upper=."
                    )
        else:  # shrink geometrically down to the first success (or lower)
            while k > lo and not attempt(k := max(k // 2, lo)):
                pass
        if best is None:
            raise BatchSizeSearchError(
                f"find_batch_size(): not even the lower bound batch size {lo * m} fits "
                f"in memory (tried {', '.join(map(str, tried))}; last error: {last_oom}). "
                "Lower `lower=`, shrink the model or sequence length, train in bfloat16 "
                "(autocast_step), accumulate gradients over smaller batches, or free "
                "memory held elsewhere (see torch.cuda.memory_summary())."
            )
        while fail is not None and fail - best > 1:  # bisect between them
            attempt((best + fail) // 2)
        return best * m, best_result

    def final(self, largest: int) -> int:
        """The size to use: ``largest`` backed off by ``margin``, a multiple, >= lower."""
        m = self.multiple_of
        backed = math.floor(largest * (1.0 - self.margin) + 1e-9) // m * m
        return max(backed, -(-self.lower // m) * m)


_POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL,
)

#: Without ``upper``, growing past this many samples means the trial ignores its size.
_GROWTH_LIMIT = 2**31


def _check_trial(fn: Callable[..., Any], what: str) -> None:
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{what} a function that runs at each batch size, but "
            f"{getattr(fn, '__qualname__', fn)!r} is a generator or coroutine function: "
            "calling it runs nothing, so every size would seem to fit. Pass a plain function."
        )


class _SearchDecorator(Protocol):
    def __call__(self, fn: Callable[Concatenate[int, P], R], /) -> Callable[P, R]: ...


@overload
def find_batch_size(
    trial_fn: Callable[[int], object],
    /,
    *,
    start: int = ...,
    lower: int = ...,
    upper: int | None = ...,
    multiple_of: int = ...,
    margin: float = ...,
) -> int: ...
@overload
def find_batch_size(
    trial_fn: None = None,
    /,
    *,
    start: int = ...,
    lower: int = ...,
    upper: int | None = ...,
    multiple_of: int = ...,
    margin: float = ...,
) -> _SearchDecorator: ...
def find_batch_size(
    trial_fn: Callable[[int], object] | None = None,
    /,
    *,
    start: int = 32,
    lower: int = 1,
    upper: int | None = None,
    multiple_of: int = 1,
    margin: float = 0.0,
) -> int | _SearchDecorator:
    """Find the largest batch size at which ``trial_fn(batch_size)`` fits in memory.

    Starting at ``start``, the size doubles while trials succeed (halves while they
    fail), then bisects between the last success and the first failure, so the
    number of trials is logarithmic. Only sizes that are multiples of
    ``multiple_of`` within ``[lower, upper]`` are tried. Out-of-memory failures
    (:func:`is_oom_error`) mark a size as too big; garbage collection and
    ``torch.cuda.empty_cache()`` run between trials; every other exception
    propagates unchanged. Memory use is assumed to grow with the batch size.

    >>> from cudakit.warmup import find_batch_size
    >>> def trial(batch_size):
    ...     if batch_size > 100:
    ...         raise torch.OutOfMemoryError("CUDA out of memory.")
    >>> find_batch_size(trial, start=16)
    100
    >>> find_batch_size(trial, start=16, multiple_of=8)
    96
    >>> find_batch_size(trial, start=16, multiple_of=8, margin=0.1)
    80

    As a decorator over ``def fn(batch_size, *args, **kwargs)``, calling
    ``fn(*args, **kwargs)`` runs a fresh search (nothing is remembered between calls)
    and returns ``fn``'s result at the chosen size. The trials are real calls, so
    the function should be one or a few steps (wrap model updates in
    :class:`preserve_state`), and should return something small: the result of the
    best trial so far is kept while the search goes on.

    >>> @find_batch_size(start=16, upper=64, multiple_of=8)
    ... def probe(batch_size, width):
    ...     return torch.zeros(batch_size, width).shape
    >>> probe(3)
    torch.Size([64, 3])

    Args:
        trial_fn: Called with a batch size; raises an out-of-memory error when the
            size does not fit. Omit it to get the decorator.
        start: First size tried (rounded down to a multiple, clamped to the bounds).
        lower: Smallest acceptable size.
        upper: Largest size to try; ``None`` grows until the first failure (on CPU,
            where the kernel may kill the process instead of raising, set it).
        multiple_of: Every size tried and returned is a multiple of this (8 suits
            tensor cores).
        margin: Fraction to back off from the largest size that fit, e.g. ``0.1``
            returns 90% of it (rounded down to a multiple, never below ``lower``), as
            headroom for fragmentation and longer inputs later.

    Returns:
        The batch size; with the decorator, ``fn``'s result at that size (``fn`` is
        called once more when ``margin`` moved the size off the tried ones).

    Raises:
        BatchSizeSearchError: even ``lower`` runs out of memory.
        TypeError: a non-int bound, a non-callable ``trial_fn``, or ``batch_size``
            passed to the decorated function.
        ValueError: bounds that contain no valid size, or ``margin`` outside [0, 1).

    .. versionadded:: 0.1
    """
    search = _Search.checked(start, lower, upper, multiple_of, margin)
    if trial_fn is not None:
        if not callable(trial_fn):
            raise TypeError(
                f"find_batch_size() expects trial_fn to be a function of the batch size, got "
                f"{type(trial_fn).__name__}. Pass it positionally: find_batch_size(trial, ...)."
            )
        _check_trial(trial_fn, "find_batch_size() calls")
        largest, _ = search.run(trial_fn)
        return search.final(largest)

    def decorate(fn: Callable[Concatenate[int, P], R]) -> Callable[P, R]:
        if not callable(fn):
            raise TypeError(
                f"@find_batch_size(...) decorates a function whose first parameter is the "
                f"batch size, got {type(fn).__name__}."
            )
        _check_trial(fn, "@find_batch_size(...) decorates")
        try:
            signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None
        params = [] if signature is None else list(signature.parameters.values())
        if signature is not None and (not params or params[0].kind not in _POSITIONAL):
            raise TypeError(
                f"@find_batch_size(...) passes the batch size as the first positional "
                f"argument, but {getattr(fn, '__qualname__', fn)}{signature} has no such "
                "parameter. Write `def fn(batch_size, ...)`."
            )

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            name = getattr(fn, "__name__", "fn")
            if "batch_size" in kwargs:
                raise TypeError(
                    f"{name}() is decorated with @find_batch_size(...), which passes the batch "
                    f"size itself; call {name}(...) without batch_size=."
                )
            if signature is not None:
                try:
                    signature.bind(0, *args, **kwargs)
                except TypeError as exc:
                    raise TypeError(
                        f"{name}() is decorated with @find_batch_size(...), which passes the "
                        f"batch size as the first argument; call it with the remaining "
                        f"arguments only ({exc})."
                    ) from None
            largest, result = search.run(lambda bs: fn(bs, *args, **kwargs))
            chosen = search.final(largest)
            if chosen == largest:
                return result  # type: ignore[return-value]
            return fn(chosen, *args, **kwargs)

        if signature is not None and params[0].kind != inspect.Parameter.VAR_POSITIONAL:
            wrapper.__signature__ = signature.replace(parameters=params[1:])  # type: ignore[attr-defined]
        return wrapper

    return decorate
