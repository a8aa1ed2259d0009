"""The micro-steps of a window: each one's backward into it, then the full window stepped.

:class:`MicroSteps` opens the window (clears the gradients of the step's parameters,
where a hand-written loop calls ``opt.zero_grad()``), runs a micro-step's backward
(divided by ``accumulate``, or summed for token-weighted losses; scaled for fp16; a
failure leaves the window as it was), counts it, and hands a full window (or a
partial one, for ``flush()``) to the :class:`~cudakit.amp._stepper.OptimizerStep`.
"""

from __future__ import annotations

import weakref
from typing import cast

import torch

from . import _misuse as misuse
from ._args import StepConfig
from ._buffers import BufferSnapshot
from ._counters import StepCounters
from ._judge import WindowJudge
from ._ops import zero_grad
from ._params import StepParams
from ._stepper import OptimizerStep
from ._window import GradSync, Stage, Window, backward_in_window, reached_any
from .result import StepResult, weight_tensor

__all__ = ["MicroSteps"]


class MicroSteps:
    """A window's micro-steps: open it, backward into it, close it through the stepper."""

    def __init__(
        self,
        config: StepConfig,
        window: Window,
        sync: GradSync,
        buffers: BufferSnapshot | None,
        counters: StepCounters,
        params: StepParams,
        stepper: OptimizerStep,
        judge: WindowJudge,
    ) -> None:
        self._optimizers = config.optimizers
        self._scaler = config.scaler if config.scaling else None
        self._skip_nonfinite = config.skip_nonfinite
        self._window = window
        self._sync = sync
        self._buffers = buffers
        self._counters = counters
        self._params = params
        self._stepper = stepper
        self._judge = judge

    def pauses(self) -> bool:
        """Whether this micro-step runs without gradient sync (it neither closes the window
        nor ends the epoch)."""
        return self._sync.active and not self._window.syncs_next()

    def before_forward(self) -> None:
        """Before a decorated step's forward: open the window, or check it; save the buffers."""
        window = self._window
        if window.stage is Stage.CLOSED:
            # Before the forward, where a hand-written loop calls zero_grad(): the
            # forward's activations can then reuse the gradients' memory.
            self.clear_grads()
        elif window.position:  # a zero_grad() left in the loop: refused before the forward
            window.check_grads()
        buffers = self._buffers
        if buffers is not None and not buffers.saved:
            buffers.save()

    def backward(
        self, loss: torch.Tensor, weight: object, *, decorated: bool, paused: bool
    ) -> torch.Tensor | None:
        """Open the window if needed (clear the step's gradients), then backward.

        ``paused``: this micro-step runs without gradient sync (decided when it began).
        Returns the token weight as a tensor (None: unweighted). A failed backward leaves
        the window as it was before this micro-step (:func:`.window.backward_in_window`).
        """
        window = self._window
        seen, given = window.backwarded, loss
        if seen is not None and seen() is loss:
            raise misuse.same_loss_error(decorated)
        weight_t: torch.Tensor | None = None
        if weight is not None:
            if window.weighted is False:
                raise misuse.mixed_weights_error()
            weight_t = weight_tensor(weight, loss)
        elif window.weighted:
            raise misuse.mixed_weights_error()
        if window.stage is Stage.CLOSED:
            self.clear_grads()
        if weight_t is None and window.accumulate != 1:
            loss = loss / window.accumulate
        scaler = self._scaler
        if scaler is not None:
            loss = scaler.scale(loss)
            if window.scale is None:
                window.scale = cast(torch.Tensor, scaler._scale).clone()
        if window.position:  # a failure puts the window's gradients back
            backward_in_window(loss, window, self._sync, self._params.params(), self.drop, paused)
        else:
            try:
                loss.backward()
            except BaseException:
                self.clear_grads()  # the window's first micro-step: no gradient stays
                raise
        if paused:
            window.mark_unsynced()
        elif self._sync.active:
            window.mark_synced()  # (a window it does not close: the epoch's last micro-step)
        window.backwarded = weakref.ref(given)
        # Counted only once its backward has run: a failed call adds no phantom weight.
        if weight_t is not None:
            window.add_weight(weight_t)
            self._counters.weighted = True
        window.weighted = weight_t is not None
        return weight_t

    def clear_grads(self) -> None:
        """Open the window: clear the gradients of the step's parameters (once per window)."""
        for opt in self._optimizers:
            zero_grad(opt)
        self._window.open()

    def drop(self) -> None:
        """Drop the open window: its gradients cleared, its buffers put back, position 0."""
        self.clear_grads()
        buffers = self._buffers
        if buffers is not None:
            buffers.restore()
            buffers.forget()
        self._window.clear()

    def check_reached(self) -> None:
        """Refuse (and drop) a full window whose losses reached none of the parameters."""
        if not reached_any(self._optimizers):
            self.drop()
            raise misuse.no_parameter_reached_error(len(self._params.params()))

    def after_backward(
        self, loss: torch.Tensor, output: object, weight: torch.Tensor | None = None
    ) -> StepResult:
        """Count the micro-step; a full window steps (or skips) through the stepper."""
        window = self._window
        if self._skip_nonfinite:
            # NaN where a token weight is negative (sqrt): the guard skips it, on the device.
            window.losses.append(loss if weight is None else loss.add(weight.sqrt(), alpha=0))
        window.last_loss = loss
        window.position += 1
        if window.position < window.accumulate:
            window.record(self._optimizers)  # to notice a zero_grad() before the next
            return StepResult(loss, output, False, False, window.scale, None)
        self.check_reached()
        return self._stepper.finish(window, loss, output, pending=None)

    def flush(self) -> StepResult | None:
        """Step on the partial window (``AutocastStep.flush``); None when nothing is pending."""
        self._judge.settle()
        window = self._window
        if window.position == 0:
            return None
        pending = window.position
        loss = window.last_loss if window.last_loss is not None else torch.zeros(())
        if window.stage is Stage.UNSYNCED:
            self._sync.sync_partial(self._params.grads)
        self.check_reached()  # (after FSDP2 has put the pending gradients in .grad)
        return self._stepper.finish(window, loss, None, pending=pending)
