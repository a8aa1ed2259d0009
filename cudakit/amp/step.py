"""The :class:`AutocastStep` that composes the parts of a mixed-precision step.

The parts each own their state: the precision ``policy`` (decided once), the
accumulation ``window`` and its gradient sync, the ``buffers`` snapshot, the
``stepper`` that finishes a window, the ``checkpoint`` (validated, saved, loaded) and
the ``misuse`` messages. This module
runs a call: open the window (clear the gradients of the step's parameters, where a
hand-written loop calls ``opt.zero_grad()``), forward under autocast, backward (divided
by ``accumulate``, or summed for token-weighted losses; scaled for fp16), and hand a
full window to the stepper. It also holds the two forms (decorator, ``with`` +
``backward``; the block itself is in ``block``), ``flush`` and the checkpoints.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from typing_extensions import ParamSpec, Unpack

from .._check import for_attribute
from . import checkpoint, misuse
from .block import ACTIVE, Block, BlockState
from .buffers import BufferSnapshot
from .counters import StepCounters
from .ops import zero_grad
from .options import check_accumulate, check_max_skipped, compile_forward, resolve_options
from .result import SteppedFunction, StepResult, extract_loss, weight_tensor
from .stepper import OptimizerStep
from .watch import Watching, WatchOptions
from .window import GradSync, Window, backward_in_window, reached_any

__all__ = ["AutocastStep", "StepResult", "SteppedFunction"]

P = ParamSpec("P")

_ACTIVE = ACTIVE  # (step, form) of the autocast_step call running here, if any


class AutocastStep(Block, Watching, misuse.AttributeGuard):
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
        compile: bool | Mapping[str, Any] = False,
        **watch: Unpack[WatchOptions],
    ) -> None:
        config = resolve_options(
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
            **watch,
        )
        self._config = config
        #: The optimizers this step steps, in order.
        self.optimizers: tuple[torch.optim.Optimizer, ...] = config.optimizers
        #: The (first) optimizer: the one optimizer of a single-optimizer step.
        self.optimizer: torch.optim.Optimizer = config.optimizers[0]
        #: The schedulers stepped after every real optimizer step, in order.
        self.schedulers: tuple[Any, ...] = config.schedulers
        #: The scheduler as given (one, a list, or None).
        self.scheduler: Any = config.scheduler
        self.model = config.model
        #: The GradScaler in use (fp16 only), else None.
        self.scaler: torch.amp.GradScaler | None = config.scaler
        #: The resolved autocast dtype (``torch.float32`` when autocast is off).
        self.dtype: torch.dtype = config.dtype
        #: The device type autocast runs on: that of the optimizers' parameters.
        self.device_type: str = config.device_type
        #: Whether autocast is on (False for ``enabled=False`` and for float32).
        self.enabled: bool = config.enabled
        #: ``torch.compile`` options when ``compile=`` is on, else None.
        self.compile_options: dict[str, Any] | None = config.compile_options
        self._counts = StepCounters(config.max_skipped)
        # Buffers (BatchNorm running stats...) as they were when the window opened,
        # restored when the window's step is skipped: a NaN batch must not poison them.
        self._buffers = (
            BufferSnapshot(config.model)
            if config.model is not None and config.skip_nonfinite
            else None
        )
        self._stepper = OptimizerStep(config, self._counts, self._buffers)
        self._scaling = self._stepper.scaling
        self._window = Window(config.accumulate)
        self._sync = GradSync(config.model)
        # (token, autocast, paused sync) entered by ``with step:``, left by __exit__.
        self._block: BlockState | None = None
        self._warned_block_compile = False
        # From `with step:` until its backward(): the micro-step's sync is decided.
        self._awaiting_backward = False
        self._as_decorated = (self, "decorated")
        self._as_block = (self, "block")
        self._sealed = True  # from here on, a public attribute is not set (a typo, read-only)

    # ------------------------------------------------------------------ read-only state

    @property
    def position(self) -> int:
        """Micro-steps accumulated in the current window (0 right after an optimizer step)."""
        return self._window.position

    @property
    def steps(self) -> int:
        """Optimizer steps that really updated the weights so far (reads pending verdicts)."""
        self._stepper.settle()
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
        if self._awaiting_backward or (active is not None and active[0] is self):
            raise misuse.accumulate_busy_error()  # this micro-step decided how it syncs
        window = self._window
        if window.position:
            raise misuse.accumulate_mid_window_error(window.position, window.accumulate)
        window.accumulate = checked

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps dropped for an inf/NaN loss or gradient (reads pending verdicts)."""
        self._stepper.settle()
        return self._counts.skipped

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold (None: no clipping)."""
        return self._stepper.max_grad_norm

    @property
    def skip_nonfinite(self) -> bool:
        """Whether inf/NaN losses and gradients skip the step."""
        return self._stepper.skip_nonfinite

    @property
    def sync_free(self) -> bool:
        """True when every optimizer skips on the device (fused Adam, AdamW, SGD...).

        A guarded step then reads nothing back from the device; its verdict is read
        lazily: one window later, or when you read a counter. On the CPU, where nothing
        waits, it is read from memory at once and a bad step skips on the host.
        """
        return self._stepper.sync_free

    def __repr__(self) -> str:
        return (
            f"AutocastStep(dtype={self.dtype}, device_type={self.device_type!r}, "
            f"enabled={self.enabled}, scaler={'on' if self._scaling else 'off'}, "
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
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)

    # ------------------------------------------------------------------ decorator form

    def __call__(self, func: Callable[P, Any]) -> SteppedFunction[P]:
        """Decorate a loss function: every call runs a full step and returns a StepResult."""
        misuse.check_decorated(func)

        compiled = self._compiled_forward(func)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> StepResult:
            return self._run(func, compiled, args, kwargs)

        w = cast(Any, self._watched(func, wrapper))
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
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
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
        window = self._window
        try:
            if not window.cleared:
                # Before the forward, where a hand-written loop calls zero_grad(): the
                # forward's activations can then reuse the gradients' memory.
                self._clear_grads()
            elif window.position:  # a zero_grad() left in the loop: refused before the forward
                window.check_grads()
            if self._buffers is not None and not self._buffers.saved:
                self._buffers.save()
            if self._sync.active and not window.closes_next():
                with self._sync.paused():
                    output = self._forward(func, compiled, args, kwargs)
                    loss, weight = extract_loss(output)
                    weight = self._backward(loss, weight)
                    window.unsynced = True
            else:
                output = self._forward(func, compiled, args, kwargs)
                loss, weight = extract_loss(output)
                weight = self._backward(loss, weight)
            return self._after_backward(loss.detach(), output, weight)
        finally:
            _ACTIVE.reset(token)

    # ------------------------------------------------------------------ explicit form

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
        block = self._block
        if block is None and self._sync.active and not self._window.closes_next():
            # backward() after the block closed: pause the sync around backward itself.
            with self._sync.paused():
                weight = self._backward(tensor, weight)
                self._window.unsynced = True
        else:
            weight = self._backward(tensor, weight)
            if block is not None and block[2] is not None:
                self._window.unsynced = True
        self._awaiting_backward = False  # the micro-step is counted below
        return self._after_backward(tensor.detach(), loss, weight)

    # ------------------------------------------------------------------ shared machinery

    def _backward(self, loss: torch.Tensor, weight: object) -> torch.Tensor | None:
        """Open the window if needed (clear the step's gradients), then backward.

        Returns the token weight as a tensor (None: unweighted). A failed backward leaves
        the window as it was before this micro-step (:func:`.window.backward_in_window`).
        """
        window = self._window
        seen, given = window.backwarded, loss
        if seen is not None and seen() is loss:
            raise misuse.same_loss_error(_ACTIVE.get() == self._as_decorated)
        weight_t: torch.Tensor | None = None
        if weight is not None:
            if window.weighted is False:
                raise misuse.mixed_weights_error()
            weight_t = weight_tensor(weight, loss)
        elif window.weighted:
            raise misuse.mixed_weights_error()
        if not window.cleared:
            self._clear_grads()
        if weight_t is None and window.accumulate != 1:
            loss = loss / window.accumulate
        if self._scaling:
            scaler = cast(torch.amp.GradScaler, self.scaler)
            loss = scaler.scale(loss)
            if window.scale is None:
                window.scale = cast(torch.Tensor, scaler._scale).clone()
        if window.position:  # a failure puts the window's gradients back
            backward_in_window(loss, window, self._sync, self._stepper.params(), self._drop_window)
        else:
            try:
                loss.backward()
            except BaseException:
                self._clear_grads()  # the window's first micro-step: no gradient stays
                raise
        window.backwarded = weakref.ref(given)
        # Counted only once its backward has run: a failed call adds no phantom weight.
        if weight_t is not None:
            window.add_weight(weight_t)
            self._counts.weighted = True
        window.weighted = weight_t is not None
        return weight_t

    def _clear_grads(self) -> None:
        """Open the window: clear the gradients of the step's parameters (once per window)."""
        for opt in self.optimizers:
            zero_grad(opt)
        self._window.cleared = True

    def _drop_window(self) -> None:
        """Drop the open window: its gradients cleared, its buffers put back, position 0."""
        self._clear_grads()
        if self._buffers is not None:
            self._buffers.restore()
            self._buffers.forget()
        self._window.clear()

    def _check_reached(self) -> None:
        """Refuse (and drop) a full window whose losses reached none of the parameters."""
        if not reached_any(self.optimizers):
            self._drop_window()
            raise misuse.no_parameter_reached_error(len(self._stepper.params()))

    def _after_backward(
        self, loss: torch.Tensor, output: object, weight: torch.Tensor | None = None
    ) -> StepResult:
        window = self._window
        if self.skip_nonfinite:
            # NaN where a token weight is negative (sqrt): the guard skips it, on the device.
            window.losses.append(loss if weight is None else loss.add(weight.sqrt(), alpha=0))
        window.last_loss = loss
        window.position += 1
        if window.position < window.accumulate:
            window.record(self.optimizers)  # to notice a zero_grad() before the next
            return StepResult(loss, output, False, False, window.scale, None)
        self._check_reached()
        return self._stepper.finish(window, loss, output, pending=None)

    # ------------------------------------------------------------------ epoch end, checkpoints

    def flush(self) -> StepResult | None:
        """Step on a partial accumulation window (at the end of an epoch).

        The gradients of the ``k < accumulate`` pending micro-batches are rescaled by
        ``accumulate / k``, so the step equals one on their mean loss (token-weighted
        windows divide by their own total weight instead). Under DDP or FSDP2 the
        pending micro-steps ran without gradient sync, so their gradients are reduced
        across ranks here first. Returns None when nothing is pending.

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
                run (nothing is changed).
            ValueError: the window's losses reached none of the optimizers' parameters.
            NonFiniteStepsError: ``max_skipped`` optimizer steps in a row were skipped.
        """
        if _ACTIVE.get() is not None:
            raise misuse.flush_inside_error()
        if self._awaiting_backward:
            raise misuse.flush_before_backward_error()
        self._stepper.settle()
        window = self._window
        if window.position == 0:
            return None
        pending = window.position
        loss = window.last_loss if window.last_loss is not None else torch.zeros(())
        if window.unsynced:
            self._sync.sync_partial(self._stepper.grads)
        self._check_reached()  # (after FSDP2 has put the pending gradients in .grad)
        return self._stepper.finish(window, loss, None, pending=pending)

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
        return checkpoint.save(self._parts())

    def _cudakit_restore(self, state: Mapping[str, Any]) -> None:
        """:meth:`load_state_dict` with the state's ``accumulate`` too, for ``preserve_state``."""
        checkpoint.restore_exact(self._parts(), state)

    def _parts(self) -> checkpoint.StepParts:
        return checkpoint.StepParts(
            self._window,
            self._counts,
            self.scaler,
            self._scaling,
            self.dtype,
            self._buffers,
            self._stepper,
            self._sync,
        )

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
        misuse.check_idle(self, _ACTIVE.get(), self._awaiting_backward)
        checkpoint.load(self._parts(), state)
