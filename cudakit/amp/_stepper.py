"""What happens when a window closes: one path from gradients to an optimizer step.

:class:`OptimizerStep` owns the optimizers, the schedulers and the loss scaler.
:meth:`OptimizerStep.finish` unscales (fp16), weights (token-weighted windows, partial
windows), asks the :class:`~cudakit.amp._judge.WindowJudge` for the verdict, clips, and
then steps every optimizer or none, and the schedulers after a real step. With
optimizers that skip on the device (fused Adam, AdamW, SGD) the same path never reads
the verdict back: it goes to the optimizers as ``found_inf`` and the judge reads it
lazily, one window later or when the counters are read.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch

from .._accel import host_read_waits
from ._args import StepConfig
from ._buffers import BufferSnapshot
from ._counters import StepCounters
from ._guard import local
from ._judge import WindowJudge
from ._ops import optimizer_step, scaler_step, step_on_device
from ._params import StepParams
from ._window import Window
from .result import SpikeVerdict, StepResult, Verdict
from .spikes import SpikeWatch
from .watch import Pending, PendingSource, scaler_step_on_device

__all__ = ["OptimizerStep", "SchedulerUndo"]


class OptimizerStep:
    """The end of a window: the optimizers, the scaler and the schedulers, on a verdict."""

    def __init__(
        self,
        config: StepConfig,
        counters: StepCounters,
        params: StepParams,
        buffers: BufferSnapshot | None,
    ) -> None:
        optimizers = config.optimizers
        self.optimizers = optimizers
        self.schedulers = config.schedulers
        self.scaler = config.scaler
        self.scaling = config.scaling
        self.counters = counters
        self.params = params
        self.buffers = buffers
        self._dtype = config.dtype
        self._guarded = config.guarded
        #: Every optimizer skips on the device: a guarded step then reads nothing back.
        self.sync_free: bool = self._guarded and all(
            getattr(o, "_step_supports_amp_scaling", False) for o in optimizers
        )
        #: Verdicts go to the optimizers on the device and are read lazily. Only where a
        #: host read waits: on the CPU every op has finished when it returns, so the
        #: verdict is read from memory at once (no op, no wait) and a bad step is skipped
        #: on the host, cheaper there than handing ``found_inf`` to the optimizer.
        self.lazy: bool = self.sync_free and host_read_waits(config.device_type)
        #: The verdict on each window: the guard, the spike rule, the lazy reads.
        self.judge = WindowJudge(config, counters, params, sync_free=self.sync_free, lazy=self.lazy)
        #: Loss spikes (``skip_spikes=``) and the replay of skipped windows (the judge's).
        self.watch = self.judge.watch
        #: Optimizers whose state, created by a skipped fused step, would not equal a fresh
        #: state (see :meth:`_states_ready`): all but Adam/AdamW and momentum-free SGD.
        self._unsafe_first_step = tuple(o for o in optimizers if not _skip_creates_fresh_state(o))
        self._ready_count = -1  # parameter count at which every parameter had state

    # ------------------------------------------------------------------ the one path

    def finish(
        self, window: Window, loss: torch.Tensor, output: object, pending: int | None
    ) -> StepResult:
        """Finish ``window``: weight, check, clip, step or skip; the window closes."""
        if self.lazy:
            try:
                self.judge.settle()  # the previous window's verdict: there by now
            except BaseException:
                # A streak error (or a raising scheduler) read from the previous window:
                # this window is dropped, its buffers put back, no stale window left.
                if self.buffers is not None:
                    self.buffers.restore()
                self._close(window)
                raise
            if self._states_ready():
                return self._finish_on_device(window, loss, output, pending)
            # An optimizer would create its state in this step: read the verdict once, so
            # a skipped step never leaves fresh, uninitialised state behind (below).
        scaler = self.scaler if self.scaling else None
        scale = window.scale
        grad_norm: torch.Tensor | None = None
        skipped = streak = spike = False
        watch, spikes = self.watch, self.watch.spikes
        calls, seed = watch.take(window) if watch.locate else (None, None)
        learnt: list[float] | None = None
        source = None
        try:
            factor = (
                self._prepare(window, pending)
                if scaler is not None or pending is not None or window.weight is not None
                else None
            )
            if self._guarded:
                if scaler is None and self.params.max_grad_norm is not None:
                    # Clipping reads every gradient for the total norm anyway: that norm is
                    # the guard (non-finite iff a gradient is, or it overflowed), so no
                    # second pass over the gradients on a good step.
                    grad_norm = self.params.clip()
                ride = watch.ride(window) if spikes is not None else None
                skipped, ride = self.judge.decide(window, scaler, grad_norm, factor, ride)
                if spikes is not None and not skipped:
                    if self.params.max_grad_norm is not None and grad_norm is None:
                        grad_norm = self.params.clip()
                    learnt = self.judge.judge_spike(window, ride, grad_norm)
                    skipped = spike = learnt is None
            if skipped:
                grad_norm = None
                if scaler is not None:
                    scaler.update()  # lowers the scale; no optimizer runs
                if self.buffers is not None:
                    self.buffers.restore()
                streak = self.counters.record_skip(spike)
                if calls is not None and not spike:
                    source = watch.locate_now(calls, seed)
            else:
                if self.params.max_grad_norm is not None and grad_norm is None:
                    grad_norm = self.params.clip()
                if scaler is not None:
                    for opt in self.optimizers:
                        scaler_step(scaler, opt)  # known clean: no second read of the flags
                    scaler.update()
                else:
                    for opt in self.optimizers:
                        optimizer_step(opt)
                self.counters.record_step()
                if learnt is not None:
                    cast(SpikeWatch, spikes).learn(learnt)
                if self.schedulers:
                    self._close(window)  # counters and window settled if one raises
                    for s in self.schedulers:
                        s.step()
        finally:
            self._close(window)
        if streak:
            raise self.counters.streak_error(self._dtype)
        return StepResult(loss, output, not skipped, skipped, scale, grad_norm, spike, source)

    def _states_ready(self) -> bool:
        """True when no optimizer creates state in this step, or when it does so safely.

        A fused optimizer told to skip through ``found_inf`` still creates its state on
        its first step: Adam and AdamW fill it with zeros and undo the step count (the
        same as no step), but SGD's momentum buffer comes from ``torch.empty_like`` and
        stays uninitialised. Such a first step, and the first step of parameters added
        later, take the path that reads the verdict, so a skip never runs ``step()``.
        """
        if not self._unsafe_first_step:
            return True
        # Once every parameter has state, only an added parameter can lack it: scan again
        # only when the parameter count changes.
        count = sum(len(g["params"]) for o in self._unsafe_first_step for g in o.param_groups)
        if count == self._ready_count:
            return True
        complete = True  # every parameter has state, with a gradient now or not
        for opt in self._unsafe_first_step:
            state = opt.state
            for group in opt.param_groups:
                for p in group["params"]:
                    if p not in state:
                        if p.grad is not None:
                            return False
                        complete = False
        if complete:
            self._ready_count = count
        return True

    # ------------------------------------------------------------------ parts

    def _close(self, window: Window) -> None:
        window.clear()
        if self.buffers is not None:
            self.buffers.forget()

    def _factor(self, window: Window, pending: int | None) -> torch.Tensor | float | None:
        """What the window's summed gradients are multiplied by before the step.

        Token-weighted: ``world / total weight over all ranks`` (DDP and FSDP2 average
        across ranks; the all-reduce of the total runs on the device, no host read).
        A partial window (``flush``), unweighted: ``accumulate / pending``.
        """
        if window.weight is not None:
            total = window.total = window.weight.clone()
            world = self.judge.world
            if world > 1:
                torch.distributed.all_reduce(total)
            return torch.reciprocal(total).mul_(world)
        if pending is not None and pending != window.accumulate:
            return window.accumulate / pending
        return None

    def _prepare(self, window: Window, pending: int | None) -> torch.Tensor | float | None:
        """Unscale (fp16) and weight the window's gradients; the factor used, if any."""
        if self.scaling:
            scaler = cast(torch.amp.GradScaler, self.scaler)
            for opt in self.optimizers:
                scaler.unscale_(opt)
        weighted = window.weight is not None
        factor = self._factor(window, pending) if pending is not None or weighted else None
        if factor is not None:
            grads = [local(g) for g in self.params.grads()]
            if grads:
                torch._foreach_mul_(grads, factor)
        return factor

    def _finish_on_device(
        self, window: Window, loss: torch.Tensor, output: object, pending: int | None
    ) -> StepResult:
        """:meth:`finish` for optimizers that skip on the device: nothing is read back.

        The verdict stays a tensor: the optimizers get it as ``found_inf`` (as
        ``GradScaler`` hands it to fused optimizers) and skip on the device; buffers are
        restored with ``torch.where``; the counters and the schedulers catch up when the
        verdict is read, one window later or when they are read.
        """
        scaler = self.scaler if self.scaling else None
        scale = window.scale
        judge, watch = self.judge, self.watch
        calls, seed = watch.take(window) if watch.locate else (None, None)
        try:
            factor = self._prepare(window, pending)
            verdict, grad_norm, posted, thresholds = judge.on_device(window, scaler, factor)
            if scaler is not None:
                for opt in self.optimizers:
                    if posted is verdict:
                        scaler.step(opt)  # fused: hands the flags to the optimizer, no read
                    else:  # the flags know inf/NaN only; the verdict knows spikes too
                        scaler_step_on_device(scaler, opt, verdict)
                scaler.update()
            else:
                for opt in self.optimizers:
                    step_on_device(opt, verdict)
            if self.buffers is not None:
                self.buffers.restore_where(verdict.reshape(()) > 0)
            # The schedulers step now, as if the step was real (it almost always is), so
            # the learning rate and the schedulers' state are current for logging and
            # checkpoints; a skip found when the verdict is read puts them back.
            undo = SchedulerUndo(self.schedulers, self.optimizers)
            item = Pending(undo, posted, thresholds, calls, seed)
            judge.post(posted, item)
            for s in self.schedulers:
                s.step()
        finally:
            self._close(window)
        return StepResult(
            loss,
            output,
            cast(bool, Verdict(verdict, skipped=False)),
            cast(bool, Verdict(verdict, skipped=True)),
            scale,
            grad_norm,
            cast(bool, SpikeVerdict(posted, thresholds)) if thresholds else False,
            PendingSource(item, watch) if calls is not None else None,
        )


def _skip_creates_fresh_state(opt: torch.optim.Optimizer) -> bool:
    """Whether a fused step skipped through ``found_inf`` leaves state equal to a fresh one."""
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        return True  # zeros, and the step count is undone on the device
    if isinstance(opt, torch.optim.SGD):
        return all(not g.get("momentum") for g in opt.param_groups)  # no state at all
    return False


class SchedulerUndo:
    """The schedulers' state and the learning rates before an optimistic scheduler step."""

    __slots__ = ("_lrs", "_optimizers", "_states")

    def __init__(self, schedulers: tuple[Any, ...], optimizers: tuple[Any, ...]) -> None:
        self._states = [(s, copy.deepcopy(s.state_dict())) for s in schedulers]
        self._optimizers = optimizers if schedulers else ()
        self._lrs = [[_snapshot(g.get("lr")) for g in opt.param_groups] for opt in self._optimizers]

    def apply(self) -> None:
        """Put the schedulers and the learning rates back."""
        for sched, state in self._states:
            sched.load_state_dict(state)
        for opt, lrs in zip(self._optimizers, self._lrs, strict=True):
            for group, lr in zip(opt.param_groups, lrs, strict=False):
                if isinstance(group.get("lr"), torch.Tensor) and isinstance(lr, torch.Tensor):
                    group["lr"].copy_(lr)
                else:
                    group["lr"] = lr


def _snapshot(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value
