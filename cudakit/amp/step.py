"""Mixed precision: :func:`autocast_step` runs a whole AMP training step for you.

One object owns the parts of a mixed-precision step whose order is easy to get
wrong: ``torch.autocast``, ``GradScaler``, gradient accumulation (with DDP's
``no_sync``), unscale-then-clip, a fused non-finite guard that keeps bad steps
away from the weights and the optimizer state, the scheduler and ``zero_grad``.

Two forms share one state. As a decorator over the function that computes the
loss::

    @autocast_step(optimizer, max_grad_norm=1.0, accumulate=4)
    def train_step(x, y):
        return loss_fn(model(x), y)

    result = train_step(x, y)

or explicitly, for loops that cannot be wrapped in a function::

    step = autocast_step(optimizer, accumulate=4)
    with step:                       # autocast (+ DDP no_sync on micro-steps)
        loss = loss_fn(model(x), y)
    result = step.backward(loss)     # backward; optimizer step when the window is full
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, NamedTuple, Protocol, cast

import torch
from typing_extensions import ParamSpec, Self

from ..exceptions import NonFiniteStepsError

__all__ = ["AutocastStep", "StepResult", "SteppedFunction", "autocast_step"]

P = ParamSpec("P")

#: Default ``max_skipped``: fp16's scaler may legitimately skip a run of early
#: steps while it lowers an over-large initial scale (2**16 halves to 1 in 16 steps);
#: bf16 and fp32 have no scale to adjust, so a streak of bad steps means trouble.
_DEFAULT_MAX_SKIPPED_FP16 = 20
_DEFAULT_MAX_SKIPPED = 10

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (step, form) of the autocast_step call running in this thread/task, if any.
_ACTIVE: ContextVar[tuple[AutocastStep, str] | None] = ContextVar(
    "cudakit_autocast_step_active", default=None
)


class StepResult(NamedTuple):
    """What one call of an :class:`AutocastStep` did.

    No field forces a host-device synchronisation: ``stepped`` and ``skipped``
    are plain bools decided by the step itself (the non-finite guard needs one
    sync per *optimizer* step, the same one ``GradScaler.step`` makes), while
    ``loss``, ``scale`` and ``grad_norm`` stay tensors on the device; only
    ``.item()``/``float()`` on them syncs, when you choose to.

    >>> r = StepResult(torch.tensor(0.5), None, True, False, None, None)
    >>> r.stepped, float(r.loss)
    (True, 0.5)

    .. versionadded:: 0.1
    """

    #: The loss the function returned, detached (not divided by ``accumulate``).
    loss: torch.Tensor
    #: The function's original return value (``None`` for :meth:`AutocastStep.flush`).
    output: Any
    #: True when the optimizer really updated the weights on this call.
    stepped: bool
    #: True when a non-finite loss or gradient was caught and the step dropped.
    skipped: bool
    #: The loss scale (0-dim float32 tensor) this call's loss was multiplied by; None without fp16.
    scale: torch.Tensor | None
    #: Total gradient norm before clipping (0-dim tensor) on clipping steps; else None.
    grad_norm: torch.Tensor | None


class SteppedFunction(Protocol[P]):
    """A loss function decorated by an :class:`AutocastStep`: each call returns a StepResult.

    .. versionadded:: 0.1
    """

    #: The :class:`AutocastStep` that runs the step (shared state).
    autocast_step: AutocastStep

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> StepResult: ...

    def flush(self) -> StepResult | None:
        """Step on a partial accumulation window; see :meth:`AutocastStep.flush`."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state; see :meth:`AutocastStep.state_dict`."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint; see :meth:`AutocastStep.load_state_dict`."""


# --------------------------------------------------------------------------- decisions


def _resolve_dtype(
    dtype: torch.dtype | str, device_type: str, enabled: bool, scaler: object
) -> torch.dtype:
    """The autocast dtype for these arguments on this device type (pure but for CUDA queries)."""
    if isinstance(dtype, str):
        if dtype == "auto":
            if not enabled:
                return torch.float32
            if scaler is not None:
                return torch.float16  # a scaler only makes sense with fp16
            if device_type == "cuda":
                return torch.bfloat16 if _cuda_native_bf16() else torch.float16
            if device_type == "mps":
                return torch.float16
            return torch.bfloat16
        alias = _DTYPE_ALIASES.get(dtype.lower())
        if alias is None:
            raise ValueError(
                f"autocast_step(dtype={dtype!r}) is not a precision cudakit knows; expected "
                '"auto", torch.bfloat16, torch.float16 or torch.float32 '
                '(or the strings "bf16", "fp16", "fp32").'
            )
        dtype = alias
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"autocast_step(dtype=...) expects a torch.dtype or 'auto', got "
            f"{type(dtype).__name__} {dtype!r}. For example: dtype=torch.bfloat16."
        )
    if dtype not in _DTYPES:
        raise ValueError(
            f"autocast_step(dtype={dtype}) is not a mixed-precision dtype; expected "
            "torch.bfloat16, torch.float16, torch.float32 (autocast off) or 'auto'."
        )
    return dtype if enabled else torch.float32


def _cuda_native_bf16() -> bool:
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.3 has no including_emulation
        major, _ = torch.cuda.get_device_capability()
        return major >= 8


def _device_type_of(optimizer: torch.optim.Optimizer) -> str:
    types: set[str] = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    if not types:
        raise ValueError(
            "autocast_step() got an optimizer with no parameters, so there is nothing to "
            "train. Build it from the model's parameters, e.g. "
            "torch.optim.AdamW(model.parameters()), before wrapping it."
        )
    if len(types) == 1:
        return types.pop()
    accel = sorted(types - {"cpu"})
    return accel[0]


def _check_autocast(device_type: str, dtype: torch.dtype, enabled: bool) -> None:
    """Raise if ``torch.autocast`` would refuse or silently disable this combination."""
    available = getattr(torch.amp.autocast_mode, "is_autocast_available", None)
    if enabled and available is not None and not available(device_type):
        raise ValueError(
            f"autocast_step(): the optimizer's parameters are on {device_type!r}, where "
            "torch.autocast is not available. Move the model to 'cuda' or 'cpu' first "
            "(cudakit.device.on_device(model, device=...)), or pass enabled=False."
        )
    if not enabled:
        return
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.autocast(device_type, dtype=dtype, enabled=True)
    except RuntimeError as e:
        raise ValueError(
            f"autocast_step(dtype={dtype}) cannot run on {device_type!r}: {e} "
            "Pass dtype='auto' to let cudakit pick the precision this device supports."
        ) from None
    for w in caught:
        if "not support" in str(w.message) or "Disabling autocast" in str(w.message):
            raise ValueError(
                f"autocast_step(dtype={dtype}) cannot run on {device_type!r}: "
                f"{str(w.message).strip()} Pass dtype='auto' to let cudakit pick the "
                "precision this device supports."
            )


def _extract_loss(output: object) -> torch.Tensor:
    """The loss inside a step function's return: a tensor, ``(loss, ...)`` or ``{"loss": ...}``."""
    # Fast path: a plain tensor that passes every check below (errors come from the slow path).
    if type(output) is torch.Tensor and output.requires_grad and output.numel() == 1:
        return output
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping):
        if "loss" not in output:
            raise TypeError(
                "autocast_step: the function returned a mapping without a 'loss' key "
                f"(keys: {sorted(map(str, output))}). Return {{'loss': loss, ...}}, a "
                "(loss, ...) tuple, or the scalar loss tensor itself."
            )
        loss = output["loss"]
    elif isinstance(output, (tuple, list)):
        if not output:
            raise TypeError(
                f"autocast_step: the function returned an empty {type(output).__name__}; "
                "return the scalar loss tensor, (loss, ...) or {'loss': loss, ...}."
            )
        loss = output[0]
    else:
        raise TypeError(
            "autocast_step: the function must return the loss: a scalar tensor, a tuple or "
            f"list whose first item is the loss, or a mapping with a 'loss' key; got "
            f"{type(output).__name__}. Did you forget `return loss`?"
        )
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"autocast_step: the loss must be a torch.Tensor, got {type(loss).__name__} "
            f"{loss!r}. Return the loss tensor itself, not loss.item()."
        )
    if loss.numel() != 1:
        raise ValueError(
            f"autocast_step: the loss must be a scalar tensor, got shape {tuple(loss.shape)}. "
            "Reduce it first, e.g. loss.mean() or loss.sum()."
        )
    if not loss.requires_grad:
        raise ValueError(
            "autocast_step: the loss does not require grad, so there is nothing to "
            "backpropagate. Was it computed under torch.no_grad()/inference_mode(), from "
            "detached tensors, or with a frozen model?"
        )
    return loss


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


_OPTIMIZER_ZERO_GRAD = torch.optim.Optimizer.zero_grad
# True while a torch profiler records (then zero_grad keeps its record_function scope).
_profiler_enabled: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def _zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, minus its per-call overhead where that is safe.

    For an optimizer that keeps torch's own ``zero_grad`` (not overridden by its class or
    on the instance), and while no profiler records, this is the same loop torch runs
    (every ``.grad`` set to None) without the dynamo-disable wrapper and
    ``record_function`` scope around it: about 7 µs a step on CPU. Otherwise the call.
    """
    if (
        getattr(optimizer.zero_grad, "__func__", None) is not _OPTIMIZER_ZERO_GRAD
        or _profiler_enabled()
    ):
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad = None


def _distributed_world() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


# --------------------------------------------------------------------------- the step


class AutocastStep:
    """A mixed-precision training step: build it with :func:`autocast_step`.

    Use it as a decorator over the loss function (``@step``), or explicitly with
    ``with step:`` around the forward pass followed by ``step.backward(loss)``.
    Both forms share the accumulation window, the loss scaler and the counters.
    Not thread-safe: one step object per training loop.

    >>> import cudakit.amp as amp
    >>> model = torch.nn.Linear(4, 1)
    >>> step = amp.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> step.dtype, step.device_type, step.enabled
    (torch.bfloat16, 'cpu', True)
    >>> with step:
    ...     loss = model(torch.ones(2, 4)).float().pow(2).mean()
    >>> step.backward(loss).stepped
    True

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        optimizer: Any,
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
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            hint = ""
            if callable(optimizer) and not isinstance(optimizer, torch.nn.Module):
                hint = (
                    " It looks like @autocast_step was used without arguments; write "
                    "@autocast_step(optimizer, ...) above the function."
                )
            elif isinstance(optimizer, torch.nn.Module):
                hint = " Pass the optimizer first, and the model as model=... (for DDP no_sync)."
            raise TypeError(
                "autocast_step() expects a torch.optim.Optimizer as its first argument, got "
                f"{type(optimizer).__name__}.{hint}"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast_step(enabled=...) expects a bool, got {enabled!r}.")
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(
                f"autocast_step(skip_nonfinite=...) expects a bool, got {skip_nonfinite!r}."
            )
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"autocast_step(accumulate={accumulate!r}) must be a positive int: the number "
                "of micro-batches whose gradients are summed before each optimizer step "
                "(1 = step on every call)."
            )
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, (int, float))
            or not math.isfinite(max_grad_norm)
            or max_grad_norm <= 0
        ):
            raise ValueError(
                f"autocast_step(max_grad_norm={max_grad_norm!r}) must be a positive finite "
                "number (e.g. 1.0), or None to turn clipping off."
            )
        if max_skipped is not None and (
            isinstance(max_skipped, bool) or not isinstance(max_skipped, int) or max_skipped < 1
        ):
            raise ValueError(
                f"autocast_step(max_skipped={max_skipped!r}) must be a positive int (the number "
                "of consecutive skipped steps that raise NonFiniteStepsError), or None for the "
                "default; pass sys.maxsize to never raise."
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"autocast_step(model=...) expects the torch.nn.Module being trained (usually "
                f"the DistributedDataParallel wrapper), got {type(model).__name__}."
            )
        if scheduler is not None:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError(
                    "autocast_step(scheduler=ReduceLROnPlateau) cannot work: it steps on a "
                    "validation metric, not once per optimizer step. Leave it out and call "
                    "scheduler.step(val_loss) after each validation."
                )
            if not callable(getattr(scheduler, "step", None)):
                raise TypeError(
                    "autocast_step(scheduler=...) expects a learning-rate scheduler with a "
                    f"step() method, got {type(scheduler).__name__}."
                )
        if scaler is not None and not callable(getattr(scaler, "scale", None)):
            raise TypeError(
                "autocast_step(scaler=...) expects a torch.amp.GradScaler, got "
                f"{type(scaler).__name__}."
            )

        device_type = _device_type_of(optimizer)
        resolved = _resolve_dtype(dtype, device_type, enabled, scaler)
        if scaler is not None and resolved != torch.float16:
            raise ValueError(
                f"autocast_step(scaler=...) was given with dtype={resolved}; loss scaling is "
                "only for float16 (bfloat16 has float32's range and needs none). Drop "
                "scaler=..., or pass dtype=torch.float16."
            )
        autocast_on = resolved != torch.float32
        _check_autocast(device_type, resolved, autocast_on)
        if autocast_on and resolved == torch.float16 and scaler is None:
            scaler = torch.amp.GradScaler(device_type)
        if scaler is not None:
            scaler_device = getattr(scaler, "_device", device_type)
            if torch.device(scaler_device).type != device_type:
                raise ValueError(
                    f"autocast_step(scaler=...) is a GradScaler for {scaler_device!r}, but the "
                    f"optimizer's parameters are on {device_type!r}. Create it as "
                    f"torch.amp.GradScaler({device_type!r})."
                )

        self.optimizer = optimizer
        self.model = model
        self.scheduler = scheduler
        #: The GradScaler in use (fp16 only), else None.
        self.scaler: torch.amp.GradScaler | None = scaler
        #: The resolved autocast dtype (``torch.float32`` when autocast is off).
        self.dtype: torch.dtype = resolved
        #: The device type autocast runs on: that of the optimizer's parameters.
        self.device_type: str = device_type
        #: Whether autocast is on (False for ``enabled=False`` and for float32).
        self.enabled: bool = autocast_on
        self.accumulate = accumulate
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skip_nonfinite = skip_nonfinite
        self.max_skipped: int = (
            max_skipped
            if max_skipped is not None
            else (_DEFAULT_MAX_SKIPPED_FP16 if resolved == torch.float16 else _DEFAULT_MAX_SKIPPED)
        )
        no_sync = getattr(model, "no_sync", None) if accumulate > 1 else None
        self._no_sync: Callable[[], AbstractContextManager[Any]] | None = (
            no_sync if callable(no_sync) else None
        )
        self._scaling = scaler is not None and scaler.is_enabled()
        # Mutable state.
        self._position = 0  # micro-steps taken in the current window
        self._steps = 0  # real optimizer steps
        self._skipped_steps = 0
        self._consecutive_skipped = 0
        self._window_losses: list[torch.Tensor] = []
        self._window_unsynced = False  # a micro-step of this window ran under no_sync
        self._scale_snapshot: torch.Tensor | None = None
        self._ones: dict[torch.device, torch.Tensor] = {}
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._primary: tuple[torch.Tensor, torch.Tensor] | None = None  # (flag, one), 1st device
        self._world: int | None = None
        # (token, autocast, no_sync) entered by ``with step:``, left by __exit__.
        self._block: (
            tuple[
                Token[tuple[AutocastStep, str] | None],
                torch.autocast,
                AbstractContextManager[Any] | None,
            ]
            | None
        ) = None
        # Built once: the hot path only reads them.
        self._as_decorated = (self, "decorated")
        self._as_block = (self, "block")
        self._guard_buffers = model is not None and skip_nonfinite
        # Buffers (BatchNorm running stats...) as they were when the window opened,
        # restored when the window's step is skipped: a NaN batch must not poison them.
        self._buffers: list[torch.Tensor] = []
        self._buffer_copies: list[torch.Tensor] = []
        self._buffers_saved = False

    # ------------------------------------------------------------------ read-only state

    @property
    def position(self) -> int:
        """Micro-steps accumulated in the current window (0 right after an optimizer step)."""
        return self._position

    @property
    def steps(self) -> int:
        """Optimizer steps that really updated the weights so far."""
        return self._steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps dropped for a non-finite loss or gradient so far."""
        return self._skipped_steps

    def __repr__(self) -> str:
        return (
            f"AutocastStep(dtype={self.dtype}, device_type={self.device_type!r}, "
            f"enabled={self.enabled}, scaler={'on' if self._scaling else 'off'}, "
            f"accumulate={self.accumulate}, max_grad_norm={self.max_grad_norm}, "
            f"skip_nonfinite={self.skip_nonfinite}, steps={self._steps}, "
            f"skipped_steps={self._skipped_steps}, position={self._position})"
        )

    # ------------------------------------------------------------------ autocast

    def autocast(self) -> torch.autocast:
        """Return a fresh ``torch.autocast`` with this step's device type, dtype and enabled flag.

        Use it for forward passes outside the step (evaluation, warm-up).

        >>> import cudakit.amp as amp
        >>> step = amp.autocast_step(torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
        >>> with step.autocast():
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.bfloat16
        """
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)

    # ------------------------------------------------------------------ decorator form

    def __call__(self, func: Callable[P, Any]) -> SteppedFunction[P]:
        """Decorate a loss function: every call runs a full step and returns a StepResult."""
        if isinstance(func, torch.Tensor):
            raise TypeError(
                "AutocastStep called with a tensor: the step object decorates a loss "
                "function. To step on a loss you computed yourself, call step.backward(loss)."
            )
        if not callable(func):
            raise TypeError(
                f"AutocastStep used as a decorator expects a function, got "
                f"{type(func).__name__}; write @autocast_step(optimizer, ...) above a `def`."
            )
        if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func):
            raise TypeError(
                f"autocast_step cannot decorate the generator or coroutine function "
                f"{getattr(func, '__qualname__', func)!r}; decorate a plain function that "
                "returns the loss."
            )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> StepResult:
            return self._run(func, args, kwargs)

        w = cast(Any, wrapper)
        w.autocast_step = self
        w.flush = self.flush
        w.state_dict = self.state_dict
        w.load_state_dict = self.load_state_dict
        return cast(SteppedFunction[P], w)

    def _nested_error(self, outer: AutocastStep) -> RuntimeError:
        where = "the same" if outer is self else "another"
        return RuntimeError(
            f"autocast_step called inside {where} autocast_step: the outer step would "
            "backpropagate and step the optimizer around this one. Call the two steps one "
            "after the other (e.g. the discriminator step, then the generator step), not "
            "nested."
        )

    def _run(self, func: Callable[..., Any], args: Any, kwargs: Any) -> StepResult:
        active = _ACTIVE.get()
        if active is not None:
            raise self._nested_error(active[0])
        token = _ACTIVE.set(self._as_decorated)
        try:
            if self._guard_buffers and not self._buffers_saved:
                self._save_buffers()
            if self._no_sync is not None and self._position + 1 < self.accumulate:
                self._window_unsynced = True
                with self._no_sync():
                    with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
                        output = func(*args, **kwargs)
                    loss = _extract_loss(output)
                    self._backward(loss)
            else:
                with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
                    output = func(*args, **kwargs)
                return self._backward_and_step(_extract_loss(output), output)
            return self._after_backward(loss.detach(), output)
        finally:
            _ACTIVE.reset(token)

    # ------------------------------------------------------------------ explicit form

    def __enter__(self) -> Self:
        """Enter autocast (and DDP ``no_sync`` when this micro-step will not step)."""
        active = _ACTIVE.get()
        if active is not None:
            raise self._nested_error(active[0])
        token = _ACTIVE.set(self._as_block)
        no_sync: AbstractContextManager[Any] | None = None
        autocast: torch.autocast | None = None
        try:
            if self._no_sync is not None and self._position + 1 < self.accumulate:
                no_sync = self._no_sync()
                no_sync.__enter__()
                self._window_unsynced = True
            autocast = torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)
            autocast.__enter__()
            if self._guard_buffers and not self._buffers_saved:
                self._save_buffers()
        except BaseException:
            self._unwind(token, autocast, no_sync, None, None, None)
            raise
        self._block = (token, autocast, no_sync)
        return self

    @staticmethod
    def _unwind(
        token: Token[tuple[AutocastStep, str] | None],
        autocast: torch.autocast | None,
        no_sync: AbstractContextManager[Any] | None,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave what ``__enter__`` entered, innermost first, each even if another raised."""
        try:
            if autocast is not None:
                autocast.__exit__(exc_type, exc, tb)
        finally:
            try:
                if no_sync is not None:
                    no_sync.__exit__(exc_type, exc, tb)
            finally:
                _ACTIVE.reset(token)

    def _save_buffers(self) -> None:
        bufs = [b for b in cast(torch.nn.Module, self.model).buffers() if b is not None]
        if len(bufs) != len(self._buffers) or any(
            a is not b for a, b in zip(bufs, self._buffers, strict=True)
        ):
            self._buffers = bufs
            self._buffer_copies = [torch.empty_like(b) for b in bufs]
        if bufs:
            torch._foreach_copy_(self._buffer_copies, bufs)
        self._buffers_saved = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        block, self._block = self._block, None
        if block is not None:
            self._unwind(*block, exc_type, exc, tb)

    def backward(self, loss: object) -> StepResult:
        """Backpropagate ``loss`` and, when the window is full, step the optimizer.

        The explicit form for loops that cannot be wrapped in a function: compute the
        loss inside ``with step:`` (autocast, plus DDP ``no_sync`` on micro-steps that
        do not step), then call this after the block, as torch recommends for backward.

        >>> import cudakit.amp as amp
        >>> model = torch.nn.Linear(3, 1)
        >>> step = amp.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
        >>> for _ in range(2):
        ...     with step:
        ...         loss = model(torch.ones(4, 3)).float().mean()
        ...     result = step.backward(loss)
        ...     print(result.stepped)
        False
        True

        Args:
            loss: the scalar loss tensor, or anything a decorated function may return
                (``(loss, ...)``, ``{"loss": loss, ...}``), kept as ``StepResult.output``.

        Returns:
            A :class:`StepResult`.

        Raises:
            TypeError: ``loss`` holds no loss tensor.
            ValueError: the loss is not a scalar or does not require grad.
            RuntimeError: called inside a decorated step function.
            NonFiniteStepsError: ``max_skipped`` optimizer steps in a row were skipped.
        """
        active = _ACTIVE.get()
        if active is not None and not (active[0] is self and active[1] == "block"):
            raise self._nested_error(active[0])
        return self._backward_and_step(_extract_loss(loss), loss)

    # ------------------------------------------------------------------ shared machinery

    def _backward_and_step(self, loss: torch.Tensor, output: object) -> StepResult:
        """Backward outside ``no_sync``, then the optimizer step when the window is full."""
        if self.accumulate == 1 and not self._scaling:
            # The usual step (no accumulation, no scaler): no per-call helpers.
            loss.backward()
            detached = loss.detach()
            self._position += 1
            if self.skip_nonfinite:
                self._window_losses.append(detached)
                if self.max_grad_norm is None and self.scheduler is None:
                    return self._guarded_step(self.optimizer, detached, output)
            return self._optimizer_step(detached, output, None)
        self._backward(loss)
        return self._after_backward(loss.detach(), output)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.accumulate != 1:
            loss = loss / self.accumulate
        if self._scaling:
            scaler = cast(torch.amp.GradScaler, self.scaler)
            loss = scaler.scale(loss)
            if self._scale_snapshot is None:
                self._scale_snapshot = cast(torch.Tensor, scaler._scale).clone()
        loss.backward()

    def _after_backward(self, loss: torch.Tensor, output: object) -> StepResult:
        if self.skip_nonfinite:
            self._window_losses.append(loss)
        self._position += 1
        if self._position < self.accumulate:
            return StepResult(loss, output, False, False, self._scale_snapshot, None)
        return self._optimizer_step(loss, output, rescale=None)

    def _ones_on(self, device: torch.device) -> torch.Tensor:
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return one

    def _flag_on(self, device: torch.device) -> torch.Tensor:
        # Persistent flags, zero between steps (re-zeroed only after a hit): no
        # allocation and no fill kernel on the hot path.
        flag = self._flags.get(device)
        if flag is None:
            flag = self._flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
        return flag

    def _found_nonfinite(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """A 1-element float tensor, > 0 iff a tensor has an inf/NaN; one fused kernel per group."""
        # With inv_scale == 1 the kernel's "unscale" multiplies by one: values are unchanged.
        # Measured on CPU, this fused check-and-multiply is the cheapest full pass torch
        # offers (``_foreach_norm``, per-tensor ``sum``/``dot``/``aminmax`` all cost as much
        # or more), and it is exact: no norm that overflows on large finite values.
        primary = self._primary
        if primary is None:
            device = tensors[0].device
            primary = self._primary = (self._flag_on(device), self._ones_on(device))
        try:  # fast path: one device (the usual one), dense tensors (mixed dtypes are fine)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, *primary)
            return primary[0]
        except RuntimeError:
            pass  # several devices, or sparse gradients: group them
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            if t.is_sparse:
                t = t.coalesce()._values()
            groups.setdefault((t.device, t.dtype), []).append(t)
        found: torch.Tensor | None = None
        per_device: dict[torch.device, torch.Tensor] = {}
        for (device, _), group in groups.items():
            flag = per_device[device] = self._flag_on(device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, self._ones_on(device))
        for flag in per_device.values():
            found = flag if found is None else found + flag.to(found.device)
        return found

    def _clip(self) -> torch.Tensor:
        opt = self.optimizer
        return torch.nn.utils.clip_grad_norm_(
            [p for g in opt.param_groups for p in g["params"]], cast(float, self.max_grad_norm)
        )

    def _optimizer_step(
        self, loss: torch.Tensor, output: object, rescale: float | None
    ) -> StepResult:
        opt = self.optimizer
        if (
            rescale is None
            and self.skip_nonfinite
            and self.max_grad_norm is None
            and not self._scaling
            and self.scheduler is None
        ):
            return self._guarded_step(opt, loss, output)
        scaler = self.scaler if self._scaling else None
        scale = self._scale_snapshot
        grad_norm: torch.Tensor | None = None
        skipped = False
        try:
            if scaler is not None:
                scaler.unscale_(opt)
            if rescale is not None:
                grads = _grads(opt)
                if grads:
                    torch._foreach_mul_(grads, rescale)
            if scaler is None and self.skip_nonfinite:
                if self.max_grad_norm is not None:
                    # Clipping reads every gradient to compute the total norm anyway: that
                    # norm is the guard (non-finite iff a gradient is, or it overflowed), so
                    # no second pass over the gradients on a good step.
                    grad_norm = self._clip()
                skipped = self._decide_skip(None, grad_norm)
            elif scaler is not None:
                skipped = self._decide_skip(scaler, None)  # the scaler's unscale_ checked
            if skipped:
                grad_norm = None
                if scaler is not None:
                    scaler.update()  # lowers the scale; the optimizer never runs
                if self._buffers_saved and self._buffers:
                    with torch.no_grad():
                        torch._foreach_copy_(self._buffers, self._buffer_copies)
                self._skipped_steps += 1
                self._consecutive_skipped += 1
            else:
                if self.max_grad_norm is not None and grad_norm is None:
                    grad_norm = self._clip()
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                self._steps += 1
                self._consecutive_skipped = 0
        finally:
            _zero_grad(opt)
            self._position = 0
            self._window_losses.clear()
            self._window_unsynced = False
            self._scale_snapshot = None
            self._buffers_saved = False
        if skipped and self._consecutive_skipped >= self.max_skipped:
            raise self._streak_error()
        return StepResult(loss, output, not skipped, skipped, scale, grad_norm)

    def _guarded_step(
        self, opt: torch.optim.Optimizer, loss: torch.Tensor, output: object
    ) -> StepResult:
        """:meth:`_optimizer_step` for the usual case: guard on; no scaler, clipping, rescale
        or scheduler. The same steps in the same order, in one frame (the hot path)."""
        clean = False
        try:
            # The guard: the window's losses and every gradient, one fused kernel, one sync.
            checks = self._window_losses + [
                p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None
            ]
            found = self._found_nonfinite(checks) if checks else None
            if self._world == 1:
                skipped = bool(found.item()) if found is not None else False
            else:
                skipped = self._reduce_verdict(found, None)
            clean = not skipped
            if skipped:
                if self._buffers_saved and self._buffers:
                    with torch.no_grad():
                        torch._foreach_copy_(self._buffers, self._buffer_copies)
                self._skipped_steps += 1
                self._consecutive_skipped += 1
            else:
                opt.step()
                self._steps += 1
                self._consecutive_skipped = 0
        finally:
            if not clean:
                for flag in self._flags.values():
                    flag.zero_()
            _zero_grad(opt)
            self._position = 0
            self._window_losses.clear()
            self._window_unsynced = False
            self._scale_snapshot = None
            self._buffers_saved = False
        if skipped and self._consecutive_skipped >= self.max_skipped:
            raise self._streak_error()
        return StepResult(loss, output, not skipped, skipped, None, None)

    def _streak_error(self) -> NonFiniteStepsError:
        return NonFiniteStepsError(
            f"autocast_step skipped {self._consecutive_skipped} optimizer steps in a row "
            f"because the loss or gradients were inf/NaN (dtype={self.dtype}, "
            f"max_skipped={self.max_skipped}); the weights and optimizer state are the "
            "last good ones. Check the data for NaNs, lower the learning rate, set "
            "max_grad_norm=..., or try dtype=torch.bfloat16; raise max_skipped=... if "
            "long streaks are expected."
        )

    def _decide_skip(
        self, scaler: torch.amp.GradScaler | None, grad_norm: torch.Tensor | None
    ) -> bool:
        """Did any rank see a non-finite loss or gradient? One host sync per optimizer step.

        The window's losses are checked together with either the scaler's own verdict
        (fp16: ``unscale_`` already checked every gradient), the clipping norm (when
        clipping computed it), or the gradients themselves, in one fused kernel. Only
        when the clipping norm is non-finite does a second, exact check run (and sync):
        it tells inf/NaN gradients from finite ones whose norm overflowed, which the
        hand-written loop would clip to zero and step on.
        """
        scaler_found: dict[torch.device, torch.Tensor] | None = None
        if scaler is None and grad_norm is None:
            # The usual guard (no scaler, no clipping): the window's losses and every
            # gradient, built in one pass (only called with skip_nonfinite on).
            checks = self._window_losses + [
                p.grad
                for g in self.optimizer.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
            clean = False
            try:
                skipped = self._reduce_verdict(self._found_nonfinite(checks), None)
                clean = not skipped
                return skipped
            finally:
                if not clean:
                    for flag in self._flags.values():
                        flag.zero_()
        checks = list(self._window_losses) if self.skip_nonfinite else []
        if scaler is not None:
            state = getattr(scaler, "_per_optimizer_states", {}).get(id(self.optimizer), {})
            scaler_found = state.get("found_inf_per_device")
            if not scaler_found:  # a scaler without torch's internals: check the grads ourselves
                scaler_found = None
                checks.extend(_grads(self.optimizer))
        elif grad_norm is not None:
            checks.append(grad_norm)
        else:
            checks.extend(_grads(self.optimizer))
        clean = False
        try:
            found = self._found_nonfinite(checks) if checks else None
            skipped = self._reduce_verdict(found, scaler_found)
            if skipped and grad_norm is not None:
                for flag in self._flags.values():
                    flag.zero_()
                checks = [*self._window_losses, *_grads(self.optimizer)]
                skipped = self._reduce_verdict(self._found_nonfinite(checks), None)
            clean = not skipped
            return skipped
        finally:
            if not clean:
                for flag in self._flags.values():
                    flag.zero_()

    def _reduce_verdict(
        self, found: torch.Tensor | None, scaler_found: dict[torch.device, torch.Tensor] | None
    ) -> bool:
        """All-reduce (MAX) the verdict across ranks, then read it: the one host sync."""
        if scaler_found:
            for flag in scaler_found.values():
                found = flag.clone() if found is None else found + flag.to(found.device)
        if found is None:
            return False
        if self._world is None:  # decided once, at the first optimizer step
            self._world = _distributed_world()
        if self._world > 1:
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
            if scaler_found:  # every rank's scaler must back off (or not) together
                for flag in scaler_found.values():
                    flag.copy_(found.reshape(flag.shape).clamp(max=1))
        return bool(found.item())

    # ------------------------------------------------------------------ epoch end, checkpoints

    def flush(self) -> StepResult | None:
        """Step on a partial accumulation window (at the end of an epoch).

        The gradients of the ``k < accumulate`` pending micro-batches are rescaled by
        ``accumulate / k``, so the step equals one on their mean loss. Under DDP the
        pending micro-steps ran under ``no_sync``, so their gradients are averaged
        across ranks here first. Returns None when nothing is pending.

        >>> import cudakit.amp as amp
        >>> model = torch.nn.Linear(3, 1)
        >>> step = amp.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4)
        >>> step.backward(model(torch.ones(2, 3)).float().mean()).stepped
        False
        >>> step.flush().stepped
        True
        >>> step.flush() is None
        True

        Returns:
            The :class:`StepResult` of the step (``output`` is None, ``loss`` is the last
            micro-batch's), or None.

        Raises:
            RuntimeError: called inside a step function or a ``with step:`` block.
            NonFiniteStepsError: ``max_skipped`` optimizer steps in a row were skipped.
        """
        active = _ACTIVE.get()
        if active is not None:
            raise RuntimeError(
                "AutocastStep.flush() called inside a step: call it after the loop over "
                "the epoch's batches, outside the decorated function or `with step:` block."
            )
        if self._position == 0:
            return None
        k = self._position
        loss = self._window_losses[-1] if self._window_losses else torch.zeros(())
        if self._window_unsynced and self._no_sync is not None and _distributed_world() > 1:
            self._average_grads_across_ranks()
        return self._optimizer_step(loss, None, rescale=self.accumulate / k)

    def _average_grads_across_ranks(self) -> None:
        dist = torch.distributed
        group = getattr(self.model, "process_group", None)
        world = dist.get_world_size(group)
        for g in _grads(self.optimizer):
            dist.all_reduce(g, group=group)
            g.div_(world)

    def state_dict(self) -> dict[str, Any]:
        """Return the step's checkpoint state: scaler, accumulation position, counters.

        Mid-window, the gradients accumulated so far are included (cloned), so a run
        resumed from this state, the model's and the optimizer's continues bit-for-bit.

        >>> import cudakit.amp as amp
        >>> step = amp.autocast_step(torch.optim.SGD(torch.nn.Linear(2, 1).parameters()))
        >>> state = step.state_dict()
        >>> state["position"], state["steps"], state["scaler"]
        (0, 0, None)
        """
        grads: list[torch.Tensor | None] = []
        if self._position:
            grads = [
                None if p.grad is None else p.grad.detach().clone()
                for g in self.optimizer.param_groups
                for p in g["params"]
            ]
        return {
            "accumulate": self.accumulate,
            "position": self._position,
            "steps": self._steps,
            "skipped_steps": self._skipped_steps,
            "consecutive_skipped": self._consecutive_skipped,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "grads": grads,
            "window_losses": [t.clone() for t in self._window_losses],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; everything is checked before anything changes.

        >>> import cudakit.amp as amp
        >>> step = amp.autocast_step(torch.optim.SGD(torch.nn.Linear(2, 1).parameters()))
        >>> step.load_state_dict(step.state_dict())

        Raises:
            ValueError: the state is from an incompatible step (other accumulate,
                scaler on/off, other parameters) or is missing keys.
        """
        keys = (
            "accumulate",
            "position",
            "steps",
            "skipped_steps",
            "consecutive_skipped",
            "scaler",
            "grads",
            "window_losses",
        )
        if not isinstance(state, Mapping):
            raise TypeError(
                f"load_state_dict() expects the dict from AutocastStep.state_dict(), got "
                f"{type(state).__name__}."
            )
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(
                f"load_state_dict(): the state is missing {missing}; pass the dict returned "
                "by AutocastStep.state_dict()."
            )
        if state["accumulate"] != self.accumulate and state["position"]:
            raise ValueError(
                f"load_state_dict(): the checkpoint was taken mid-window with accumulate="
                f"{state['accumulate']}, but this step has accumulate={self.accumulate}. "
                "Resume with the same accumulate=..., or checkpoint right after an optimizer step."
            )
        if (state["scaler"] is None) != (self.scaler is None):
            raise ValueError(
                "load_state_dict(): the checkpoint was "
                f"{'taken without' if state['scaler'] is None else 'taken with'} a GradScaler "
                f"but this step {'has one' if self.scaler is not None else 'has none'} "
                f"(dtype={self.dtype}). Resume with the same dtype=... as the checkpointed run."
            )
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grads = list(state["grads"])
        if state["position"] and len(grads) != len(params):
            raise ValueError(
                f"load_state_dict(): the checkpoint holds gradients for {len(grads)} "
                f"parameters but the optimizer has {len(params)}; resume with the same model "
                "and optimizer."
            )
        for p, g in zip(params, grads, strict=False):
            if g is not None and tuple(g.shape) != tuple(p.shape):
                raise ValueError(
                    f"load_state_dict(): a checkpointed gradient has shape {tuple(g.shape)} "
                    f"but its parameter has shape {tuple(p.shape)}; resume with the same model."
                )
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if state["position"]:
            for p, g in zip(params, grads, strict=False):
                p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype, copy=True)
        self._position = int(state["position"])
        self._steps = int(state["steps"])
        self._skipped_steps = int(state["skipped_steps"])
        self._consecutive_skipped = int(state["consecutive_skipped"])
        self._window_losses = [torch.as_tensor(t) for t in state["window_losses"]]
        self._scale_snapshot = None  # taken again by the next backward


def autocast_step(
    optimizer: torch.optim.Optimizer,
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
) -> AutocastStep:
    """Build a mixed-precision training step: autocast, scaling, clipping, accumulation, guard.

    Decorate the function that computes the loss; each call then runs the forward
    under ``torch.autocast``, backpropagates the (scaled, ``/accumulate``) loss and,
    on every ``accumulate``-th call, unscales, checks for inf/NaN, clips, steps the
    optimizer and the scheduler and zeroes the gradients. A step with a non-finite
    loss or gradient is skipped: the weights and the optimizer state are untouched.

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
        optimizer: the optimizer to step; its parameters' device picks ``device_type``.
        model: the model being trained (optional). When it has ``no_sync`` (DDP),
            micro-steps that do not step run under it, so gradients are all-reduced once
            per step; and its buffers (BatchNorm statistics) are restored when a step is
            skipped, so a NaN batch cannot poison them.
        dtype: ``"auto"`` (bf16 on CPU and on GPUs with native bf16, else fp16),
            ``torch.bfloat16``, ``torch.float16`` or ``torch.float32`` (autocast off).
        enabled: False turns autocast and scaling off (a plain fp32 step).
        scaler: a ``torch.amp.GradScaler`` to use instead of a fresh one (fp16 only;
            with ``dtype="auto"`` it selects fp16).
        max_grad_norm: clip the total gradient norm to this, after unscaling, once per
            optimizer step; None turns clipping off.
        accumulate: number of calls whose gradients are summed per optimizer step;
            each loss is divided by it.
        scheduler: an LR scheduler stepped after every real (not skipped) optimizer step.
        skip_nonfinite: check the loss and gradients for inf/NaN (one fused kernel and
            one host sync per optimizer step, none on micro-steps; with ``max_grad_norm``
            the clipping norm is what gets checked, and only a non-finite norm costs a
            second, exact pass) and skip bad steps. fp16's scaler always
            skips non-finite gradients; False only drops the loss check there.
        max_skipped: raise :class:`~cudakit.exceptions.NonFiniteStepsError` after this
            many skipped optimizer steps in a row. Default 20 for fp16 (the scaler may
            skip a run of early steps while it finds its scale), 10 otherwise.

    Returns:
        An :class:`AutocastStep`, usable as ``@decorator``, ``with step:`` plus
        ``step.backward(loss)``, and exposing ``dtype``, ``device_type``, ``enabled``
        and ``autocast()``.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, or an option has the wrong type.
        ValueError: an option is out of range, the optimizer has no parameters, or the
            device cannot run the requested dtype.

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
    )
