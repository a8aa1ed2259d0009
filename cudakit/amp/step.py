"""The :class:`AutocastStep` that composes the parts of a mixed-precision step.

The parts each own their state, and are handed the one frozen
:class:`~cudakit.amp._args.StepConfig` the option checks made: the accumulation
``window`` and its gradient sync, the ``buffers`` snapshot, the ``microstep`` part
(a micro-step's backward into the window), the ``stepper`` that finishes a window on
the ``judge``'s verdict, the explicit form's ``block``, the ``checkpoint`` (validated,
saved, loaded) and the ``misuse`` messages. This module runs a call of either form
through them: open the window, forward under autocast, backward, and hand a full
window to the stepper.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Self, TypedDict, cast

import torch
from typing_extensions import ParamSpec, Unpack

from .._check import for_attribute
from ..parallel._unused import note_unused_parameters
from . import _misuse as misuse
from ._args import check_accumulate, check_max_skipped, resolve_options
from ._block import ACTIVE, Block
from ._buffers import BufferSnapshot
from ._checkpoint import StepCheckpoint
from ._compiling import compile_forward
from ._counters import StepCounters
from ._microstep import MicroSteps
from ._params import StepParams
from ._stepper import OptimizerStep
from ._window import GradSync, Window
from .result import SteppedFunction, StepResult, WindowState, extract_loss
from .spikes import SpikeRule

__all__ = ["AutocastStep", "StepOptions", "StepResult", "SteppedFunction"]

P = ParamSpec("P")

_ACTIVE = ACTIVE  # (step, form) of the autocast_step call running here, if any


class StepOptions(TypedDict, total=False):
    """The keyword options of :class:`AutocastStep` (``**options``): those of
    :func:`~cudakit.amp.autocast_step`, described there. The step hands them, unopened,
    to the checks that read them.

    .. versionadded:: 0.1
    """

    model: torch.nn.Module | None
    dtype: torch.dtype | str
    enabled: bool
    scaler: torch.amp.GradScaler | None
    max_grad_norm: float | None
    accumulate: int
    scheduler: Any
    skip_nonfinite: bool
    max_skipped: int | None
    compile: bool | Mapping[str, Any]
    skip_spikes: bool | str | SpikeRule | None
    locate_nonfinite: bool


class AutocastStep(misuse.AttributeGuard):
    """A mixed-precision training step: build it with :func:`autocast_step`.

    Use it as a decorator over the loss function (``@step``), or explicitly with
    ``with step:`` around the forward pass followed by ``step.backward(loss)``.
    Both forms share the accumulation window, the loss scaler and the counters.
    Not thread-safe: one step object per training loop.

    >>> import cudakit.amp as amp
    >>> model = torch.nn.Linear(4, 1)
    >>> step = amp.autocast_step(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), dtype="bf16"
    ... )
    >>> step.dtype, step.device_type, step.enabled
    (torch.bfloat16, 'cpu', True)
    >>> with step:
    ...     loss = model(torch.ones(2, 4)).float().pow(2).mean()
    >>> step.backward(loss).stepped
    True

    .. versionadded:: 0.1
    """

    _OPTIONS = frozenset(StepOptions.__annotations__)  # (fixed when built: the guard's words)

    def __init__(self, optimizer: Any, **options: Unpack[StepOptions]) -> None:
        config = resolve_options(optimizer, **options)
        self._config = config
        self._counts = StepCounters(config.max_skipped)
        # Buffers (BatchNorm running stats...) as they were when the window opened,
        # restored when the window's step is skipped: a NaN batch must not poison them.
        model = config.model
        buffers = BufferSnapshot(model) if model is not None and config.skip_nonfinite else None
        params = StepParams(config.optimizers, config.max_grad_norm, model)
        self._stepper = OptimizerStep(config, self._counts, params, buffers)
        self._judge = judge = self._stepper.judge
        self._window = window = Window(config.accumulate)
        self._sync = sync = GradSync(model)
        self._micro = MicroSteps(
            config, window, sync, buffers, self._counts, params, self._stepper, judge
        )
        # A fresh torch.autocast with the step's device type, dtype and enabled flag.
        self._autocast = functools.partial(
            torch.autocast, config.device_type, dtype=config.dtype, enabled=config.enabled
        )
        self._block = Block((self, "block"), self._autocast, sync, window, buffers)
        self._checkpoint = StepCheckpoint(
            config, window, self._counts, buffers, params, judge, sync
        )
        self._warned_block_compile = False
        self._as_decorated = (self, "decorated")
        self._sealed = True  # from here on, a public attribute is not set (a typo, read-only)

    # ------------------------------------------------------------------ configuration

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers this step steps, in order."""
        return self._config.optimizers

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The (first) optimizer: the one optimizer of a single-optimizer step."""
        return self._config.optimizers[0]

    @property
    def schedulers(self) -> tuple[Any, ...]:
        """The schedulers stepped after every real optimizer step, in order."""
        return self._config.schedulers

    @property
    def scheduler(self) -> Any:
        """The scheduler as given (one, a list, or None)."""
        return self._config.scheduler

    @property
    def model(self) -> torch.nn.Module | None:
        """The model given as ``model=`` (None if none)."""
        return self._config.model

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use (fp16 only), else None."""
        return self._config.scaler

    @property
    def dtype(self) -> torch.dtype:
        """The resolved autocast dtype (``torch.float32`` when autocast is off)."""
        return self._config.precision.dtype

    @property
    def device_type(self) -> str:
        """The device type autocast runs on: that of the optimizers' parameters."""
        return self._config.device_type

    @property
    def enabled(self) -> bool:
        """Whether autocast is on (False for ``enabled=False`` and for float32)."""
        return self._config.precision.autocast

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """``torch.compile`` options when ``compile=`` is on, else None."""
        return self._config.compile_options

    # ------------------------------------------------------------------ read-only state

    @property
    def position(self) -> int:
        """Micro-steps accumulated in the current window (0 right after an optimizer step)."""
        return self._window.position

    @property
    def window(self) -> WindowState:
        """The accumulation window the step fills, for cudakit's own parts to read.

        ``speed_report`` and ``Checkpointer`` bind it once and read its ``position``
        and backward mark at each call, without a property call per step. Read it,
        never change it: user code reads :attr:`position` and :attr:`accumulate`.
        """
        return self._window

    @property
    def steps(self) -> int:
        """Optimizer steps that really updated the weights so far (reads pending verdicts)."""
        self._judge.settle()
        return self._counts.steps

    @property
    def max_skipped(self) -> int:
        """Skipped optimizer steps in a row that raise ``NonFiniteStepsError``."""
        return self._counts.max_skipped

    @max_skipped.setter
    def max_skipped(self, value: int | None) -> None:
        try:
            checked = check_max_skipped("AutocastStep", value)
        except (TypeError, ValueError) as exc:
            raise for_attribute("AutocastStep", "max_skipped", exc) from None
        self._counts.max_skipped = (
            checked if checked is not None else self._config.default_max_skipped
        )

    @property
    def accumulate(self) -> int:
        """Micro-steps per optimizer step; settable between windows (e.g. per epoch).

        >>> import cudakit.amp as amp
        >>> step = amp.autocast_step(
        ...     torch.optim.SGD(torch.nn.Linear(2, 1).parameters())
        ... )
        >>> step.accumulate = 4      # before a window opens: the next window has 4
        >>> step.accumulate
        4

        Raises:
            TypeError, ValueError: not an int >= 1.
            ValueError: the current window has micro-steps (call :meth:`flush`, or set
                it after the window's optimizer step).
        """
        return self._window.accumulate

    @accumulate.setter
    def accumulate(self, value: int) -> None:
        try:
            checked = check_accumulate("AutocastStep", value)
        except (TypeError, ValueError) as exc:
            raise for_attribute("AutocastStep", "accumulate", exc) from None
        if checked == self._window.accumulate:
            return
        active = _ACTIVE.get()
        if self._block.awaiting_backward or (active is not None and active[0] is self):
            raise misuse.accumulate_busy_error()  # this micro-step decided how it syncs
        window = self._window
        if window.position:
            raise misuse.accumulate_mid_window_error(window.position, window.accumulate)
        window.accumulate = checked

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps dropped for an inf/NaN loss or gradient (reads pending verdicts)."""
        self._judge.settle()
        return self._counts.skipped

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold (None: no clipping)."""
        return self._config.max_grad_norm

    @property
    def skip_nonfinite(self) -> bool:
        """Whether inf/NaN losses and gradients skip the step."""
        return self._config.skip_nonfinite

    @property
    def sync_free(self) -> bool:
        """True when every optimizer skips on the device (fused Adam, AdamW, SGD...).

        A guarded step then reads nothing back from the device; its verdict is read
        lazily: one window later, or when you read a counter. On the CPU, where nothing
        waits, it is read from memory at once and a bad step skips on the host.
        """
        return self._stepper.sync_free

    @property
    def spike_steps(self) -> int:
        """Optimizer steps skipped for a loss spike (reads pending verdicts).

        They are counted in ``skipped_steps`` too.
        """
        self._judge.settle()
        return self._counts.spikes

    @property
    def skip_spikes(self) -> SpikeRule | None:
        """The loss-spike rule in force, or None."""
        return self._judge.watch.rule

    @property
    def locate_nonfinite(self) -> bool:
        """Whether a window skipped for an inf/NaN is replayed to name its producer."""
        return self._judge.watch.locate

    def __repr__(self) -> str:
        return (
            f"AutocastStep(dtype={self.dtype}, device_type={self.device_type!r}, "
            f"enabled={self.enabled}, scaler={'on' if self._config.scaling else 'off'}, "
            f"optimizers={len(self.optimizers)}, accumulate={self._window.accumulate}, "
            f"max_grad_norm={self.max_grad_norm}, skip_nonfinite={self.skip_nonfinite}, "
            f"steps={self._counts.steps}, skipped_steps={self._counts.skipped}, "
            f"position={self._window.position})"
        )

    # ------------------------------------------------------------------ autocast

    def autocast(self) -> torch.autocast:
        """Return a fresh ``torch.autocast`` with this step's device type, dtype and enabled flag.

        Use it for forward passes outside the step (evaluation, warm-up).

        >>> import cudakit.amp as amp
        >>> step = amp.autocast_step(
        ...     torch.optim.SGD(torch.nn.Linear(2, 2).parameters()),
        ...     dtype=torch.bfloat16,
        ... )
        >>> with step.autocast():
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.bfloat16
        """
        return self._autocast()

    # ------------------------------------------------------------------ decorator form

    def __call__(self, func: Callable[P, Any]) -> SteppedFunction[P]:
        """Decorate a loss function: every call runs a full step and returns a StepResult."""
        misuse.check_decorated(func)

        compiled = self._compiled_forward(func)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> StepResult:
            return self._run(func, compiled, args, kwargs)

        w = cast(Any, self._judge.watch.wrap(func, wrapper, self._sync, self.autocast))
        w.autocast_step = self
        w.flush = self.flush
        w.state_dict = self.state_dict
        w.load_state_dict = self.load_state_dict
        return cast(SteppedFunction[P], w)

    def _compiled_forward(self, func: Callable[..., Any]) -> Callable[..., Any] | None:
        """With ``compile=``: ``func`` under autocast, compiled (autocast inside the graph)."""
        if self.compile_options is None:
            return None
        return compile_forward(
            func, self.compile_options, self.device_type, self.dtype, self.enabled
        )

    def _forward(
        self, func: Callable[..., Any], compiled: Callable[..., Any] | None, args: Any, kwargs: Any
    ) -> Any:
        if compiled is not None:
            return compiled(*args, **kwargs)
        with self._autocast():
            return func(*args, **kwargs)

    def _run(
        self,
        func: Callable[..., Any],
        compiled: Callable[..., Any] | None,
        args: Any,
        kwargs: Any,
    ) -> StepResult:
        active = _ACTIVE.get()
        if active is not None:
            raise misuse.nested_error(active[0] is self)
        if not torch.is_grad_enabled():
            raise misuse.no_grad_error()
        token = _ACTIVE.set(self._as_decorated)
        micro = self._micro
        try:
            micro.before_forward()
            if micro.pauses():
                with self._sync.paused():
                    output = self._forward(func, compiled, args, kwargs)
                    loss, weight = extract_loss(output)
                    weight = micro.backward(loss, weight, decorated=True, paused=True)
            else:
                output = self._forward(func, compiled, args, kwargs)
                loss, weight = extract_loss(output)
                weight = micro.backward(loss, weight, decorated=True, paused=False)
            return micro.after_backward(loss.detach(), output, weight)
        except RuntimeError as exc:  # DDP's unused parameters, named
            note_unused_parameters(exc)
            raise
        finally:
            _ACTIVE.reset(token)

    # ------------------------------------------------------------------ explicit form

    def __enter__(self) -> Self:
        """Enter autocast (and pause gradient sync when this micro-step will not step)."""
        self._block.enter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._block.exit(exc_type, exc, tb)

    def backward(self, loss: object) -> StepResult:
        """Backpropagate ``loss`` and, when the window is full, step the optimizers.

        The explicit form for loops that cannot be wrapped in a function: compute the
        loss inside ``with step:`` (autocast, plus paused gradient sync on micro-steps
        that do not step), then call this after the block, as torch recommends for
        backward. An exception inside the backward (or Ctrl-C) leaves the window as it
        was before this micro-step.

        >>> import cudakit.amp as amp
        >>> model = torch.nn.Linear(3, 1)
        >>> step = amp.autocast_step(
        ...     torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2
        ... )
        >>> for _ in range(2):
        ...     with step:
        ...         loss = model(torch.ones(4, 3)).float().mean()
        ...     result = step.backward(loss)
        ...     print(result.stepped)
        False
        True

        Args:
            loss: the scalar loss tensor, or anything a decorated function may return
                (``(loss, ...)``, ``{"loss": loss, ...}``,
                ``{"loss": summed_loss, "weight": count}``), kept as ``StepResult.output``.

        Returns:
            What this call did, as a ``StepResult``.

        Raises:
            TypeError: ``loss`` holds no loss tensor, or not a real floating-point one.
            ValueError: the loss is not a scalar or does not require grad, or the
                window's losses reached none of the optimizers' parameters.
            RuntimeError: called inside a decorated step function; the loss tensor of
                the previous call came again; the window's gradients were cleared
                since its last micro-step (a ``zero_grad()`` left in the loop).
            NonFiniteStepsError: ``max_skipped`` optimizer steps in a row were skipped.
        """
        active = _ACTIVE.get()
        if active is not None and not (active[0] is self and active[1] == "block"):
            raise misuse.nested_error(active[0] is self)
        tensor, weight = extract_loss(loss, explicit=True)
        if self.compile_options is not None and not self._warned_block_compile:
            self._warned_block_compile = True
            misuse.warn_block_compile()
        block, micro = self._block, self._micro
        if block.inside:
            weight = micro.backward(tensor, weight, decorated=False, paused=block.paused)
        elif block.decided_pause if block.awaiting_backward else micro.pauses():
            # backward() after the block closed: pause the sync around backward itself (as
            # the block decided, even if last_micro_step() was left since).
            with self._sync.paused():
                weight = micro.backward(tensor, weight, decorated=False, paused=True)
        else:
            weight = micro.backward(tensor, weight, decorated=False, paused=False)
        block.backward_done()  # the micro-step is counted below
        return micro.after_backward(tensor.detach(), loss, weight)

    # ------------------------------------------------------------------ epoch end, checkpoints

    def flush(self) -> StepResult | None:
        """Step on a partial accumulation window (at the end of an epoch).

        The gradients of the ``k < accumulate`` pending micro-batches are rescaled by
        ``accumulate / k``, so the step equals one on their mean loss (token-weighted
        windows divide by their own total weight instead). Under DDP or FSDP2 the
        pending micro-steps ran without gradient sync, so their gradients are reduced
        across ranks here first, unless the last of them ran inside
        :meth:`last_micro_step` and synced them itself. Returns None when nothing is
        pending.

        >>> import cudakit.amp as amp
        >>> model = torch.nn.Linear(3, 1)
        >>> step = amp.autocast_step(
        ...     torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4
        ... )
        >>> step.backward(model(torch.ones(2, 3)).float().mean()).stepped
        False
        >>> step.flush().stepped
        True
        >>> step.flush() is None
        True

        Returns:
            The step's result as a ``StepResult`` (``output`` is None, ``loss`` is
            the last micro-batch's), or None when nothing was pending.

        Raises:
            RuntimeError: called inside a step function or a ``with step:`` block, or
                before that block's ``step.backward(loss)``; under DDP with a
                communication hook (``register_comm_hook``), which the flush cannot
                run, when the window's last micro-step did not sync inside
                :meth:`last_micro_step` (nothing is changed).
            ValueError: the window's losses reached none of the optimizers' parameters.
            NonFiniteStepsError: ``max_skipped`` optimizer steps in a row were skipped.
        """
        if _ACTIVE.get() is not None:
            raise misuse.flush_inside_error()
        if self._block.awaiting_backward:
            raise misuse.flush_before_backward_error()
        return self._micro.flush()

    @contextlib.contextmanager
    def last_micro_step(self) -> Iterator[None]:
        """Mark the micro-step run inside as the last of the epoch: it syncs its gradients.

        Under DDP or FSDP2, the micro-steps of a window that do not fill it run without
        gradient sync. The epoch's last one, inside this context, syncs in its own
        backward instead (as a hand-written loop does), so a partial window's gradients
        are reduced by DDP itself, communication hook included (``fp16_compress_hook``,
        PowerSGD, yours); :meth:`flush` then steps on them with nothing left to reduce.
        A full window steps as usual. :meth:`Checkpointer.batches
        <cudakit.Checkpointer.batches>` and ``prefetch(loader, step=step)`` enter it
        for the last batch themselves where the epoch's length is known.

        >>> import cudakit.amp as amp
        >>> model = torch.nn.Linear(3, 1)
        >>> step = amp.autocast_step(
        ...     torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4
        ... )
        >>> with step.last_micro_step():
        ...     step.backward(model(torch.ones(2, 3)).float().mean()).stepped
        False
        >>> step.flush().stepped
        True

        Enter it before ``with step:`` (that block decides how its micro-step syncs).
        Outside DDP and FSDP2, and on one process, it changes nothing.

        Raises:
            RuntimeError: entered inside the step function or ``with step:``, or
                between that block and its ``step.backward(loss)``.

        .. versionadded:: 0.1
        """
        active = _ACTIVE.get()
        if self._block.awaiting_backward or (active is not None and active[0] is self):
            raise misuse.last_micro_step_busy_error()
        window = self._window
        before, window.ends = window.ends, True
        try:
            yield
        finally:
            window.ends = before

    def state_dict(self) -> dict[str, Any]:
        """Return the step's checkpoint state: scaler, accumulation position, counters.

        Mid-window, the gradients accumulated so far are included (cloned), so a run
        resumed from this state, the model's and the optimizers' continues bit for bit.

        >>> import cudakit.amp as amp
        >>> step = amp.autocast_step(
        ...     torch.optim.SGD(torch.nn.Linear(2, 1).parameters())
        ... )
        >>> state = step.state_dict()
        >>> state["position"], state["steps"], state["scaler"]
        (0, 0, None)

        Raises:
            RuntimeError: mid-window under FSDP2, or under DDP on several ranks (each
                rank's window holds its own gradients): checkpoint at a window boundary
                (``step.position == 0``), or call :meth:`flush` first.
        """
        return self._checkpoint.save()

    def _cudakit_restore(self, state: Mapping[str, Any]) -> None:
        """:meth:`load_state_dict` with the state's ``accumulate`` too, for ``preserve_state``."""
        self._checkpoint.restore_exact(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the whole state is checked before anything changes.

        >>> import cudakit.amp as amp
        >>> step = amp.autocast_step(
        ...     torch.optim.SGD(torch.nn.Linear(2, 1).parameters())
        ... )
        >>> step.load_state_dict(step.state_dict())

        Raises:
            TypeError: the state, or a field of it, has the wrong kind.
            ValueError: a field is out of range, or the state is from an incompatible
                step (other accumulate mid-window, scaler on/off, other parameters).
            RuntimeError: called inside the step function or ``with step:``, or before
                that block's ``step.backward(loss)``.
        """
        misuse.check_idle(self, _ACTIVE.get(), self._block.awaiting_backward)
        self._checkpoint.load(state)
