"""What happens when a window closes: one path from gradients to an optimizer step.

:class:`OptimizerStep` owns the optimizers, the schedulers, the loss scaler, the
non-finite guard and the counters. :meth:`OptimizerStep.finish` unscales (fp16),
weights (token-weighted windows, partial windows), checks, clips, and then steps
every optimizer or none, and the schedulers after a real step. With optimizers that
skip on the device (fused Adam, AdamW, SGD) the same path never reads the verdict
back: it goes to the optimizers as ``found_inf`` and is read lazily
(:meth:`OptimizerStep.settle`), one window later or when the counters are read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch

from .._accel import host_read_waits
from .buffers import BufferSnapshot
from .counters import StepCounters
from .guard import NonFiniteGuard, VerdictMailbox, local
from .ops import (
    check_and_clip,
    check_clip_and_judge,
    optimizer_step,
    scaler_step,
    step_on_device,
)
from .options import StepConfig, captures_cuda_graphs, compile_fn
from .result import SpikeVerdict, StepResult, Verdict
from .spikes import SpikeWatch
from .watch import Pending, PendingSource, Watch, scaler_step_on_device
from .window import Window

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """The end of a window: the verdict, the optimizers, the scaler and the schedulers."""

    def __init__(
        self, config: StepConfig, counters: StepCounters, buffers: BufferSnapshot | None
    ) -> None:
        optimizers, compile_options = config.optimizers, config.compile_options
        max_grad_norm = config.max_grad_norm
        #: Loss spikes (``skip_spikes=``) and the replay of skipped windows (``locate_nonfinite=``).
        self.watch = Watch(config)
        self.optimizers = optimizers
        self.schedulers = config.schedulers
        self.scaler = config.scaler
        self.scaling = config.scaling
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = config.skip_nonfinite
        self.counters = counters
        self.buffers = buffers
        self._dtype = config.dtype
        self._single = optimizers[0] if len(optimizers) == 1 else None
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
        self._guard = NonFiniteGuard()
        # A sync-free step on the CPU reads its verdict from memory, without a torch op;
        # other steps make their one read with .item() (measured a little faster there).
        self._read = (
            NonFiniteGuard.read_memory if self.sync_free and not self.lazy else NonFiniteGuard.read
        )
        self._mailbox = VerdictMailbox()
        self._pending: list[Pending] = []  # one per posted verdict
        self._total: torch.Tensor | None = None  # a token-weighted window's total weight
        #: Optimizers whose state, created by a skipped fused step, would not equal a fresh
        #: state (see :meth:`_states_ready`): all but Adam/AdamW and momentum-free SGD.
        self._unsafe_first_step = tuple(o for o in optimizers if not _skip_creates_fresh_state(o))
        self._ready_count = -1  # parameter count at which every parameter had state
        # Compiled on the sync-free path with clipping only, where inductor fuses the
        # check, the norm and the scaling (a GPU's eager check is one fused kernel
        # already). Measured on the CPU, the compiled region cost more than the eager
        # check and clip (its guards alone check every tensor), so the CPU never uses it.
        self._compiled_check: Callable[..., torch.Tensor | None] | None = (
            compile_fn(check_and_clip, compile_options, fullgraph=True)
            if compile_options is not None and self.lazy and max_grad_norm is not None
            else None
        )
        # With a spike rule the same region judges the window too (one process, no
        # scaler): its thresholds go in as floats, which dynamo must not specialize on
        # (a graph per threshold); where it would (older torch), or where the region
        # would be captured in a CUDA graph (whose inputs are tensors), the test stays
        # eager.
        self._compiled_judge: Callable[..., Any] | None = (
            compile_fn(check_clip_and_judge, compile_options or {}, fullgraph=True)
            if self._compiled_check is not None
            and self.watch.spikes is not None
            and not self.scaling
            and getattr(torch._dynamo.config, "specialize_float", True) is False
            and not captures_cuda_graphs(compile_options or {})
            else None
        )

    # ------------------------------------------------------------------ parameters

    def params(self) -> list[torch.Tensor]:
        """The parameters of every optimizer, each once, in the optimizers' order."""
        if self._single is not None:
            return [p for g in self._single.param_groups for p in g["params"]]
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        return list({id(p): p for p in params}.values())

    def grads(self) -> list[torch.Tensor]:
        """The gradients of :meth:`params` that exist."""
        if self._single is not None:
            return [
                p.grad for g in self._single.param_groups for p in g["params"] if p.grad is not None
            ]
        return [p.grad for p in self.params() if p.grad is not None]

    # ------------------------------------------------------------------ the one path

    def finish(
        self, window: Window, loss: torch.Tensor, output: object, pending: int | None
    ) -> StepResult:
        """Finish ``window``: weight, check, clip, step or skip; the window closes."""
        if self.lazy:
            try:
                self.settle()  # the previous window's verdict: there by now
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
                if scaler is None and self.max_grad_norm is not None:
                    # Clipping reads every gradient for the total norm anyway: that norm is
                    # the guard (non-finite iff a gradient is, or it overflowed), so no
                    # second pass over the gradients on a good step.
                    grad_norm = self.clip()
                ride = watch.ride(window) if spikes is not None else None
                skipped, ride = self._decide_skip(window, scaler, grad_norm, factor, ride)
                if spikes is not None and not skipped:
                    if self.max_grad_norm is not None and grad_norm is None:
                        grad_norm = self.clip()
                    learnt = watch.judge_host(window, ride, grad_norm, self)
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
                if self.max_grad_norm is not None and grad_norm is None:
                    grad_norm = self.clip()
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

    def settle(self) -> None:
        """Read the verdicts of sync-free windows: counters, schedulers, the streak error."""
        if not self._mailbox:
            return
        streak = False
        pending, self._pending = self._pending, []
        spikes = self.watch.spikes
        # Posted with the verdict: the statistics the rule of the time watched (none
        # without one, or when the rule changed since: those windows are not judged).
        watched = len(spikes.on) + 1 if spikes is not None else 0
        for values, item in zip(self._mailbox.drain_values(), pending, strict=True):
            found = values[0] > 0
            spike = False
            if not found and len(values) == watched:
                if watched == 2:  # one statistic: the common case, without a loop
                    spike = values[1] > item.thresholds[0]
                else:
                    spike = SpikeWatch.is_spike(values[1:], item.thresholds)
            if found or spike:
                item.undo.apply()  # the schedulers stepped ahead of a step that did not happen
                streak = self.counters.record_skip(spike) or streak
            else:
                self.counters.record_step()
                if len(values) == watched:
                    spikes = cast(SpikeWatch, spikes)
                    if watched == 2:
                        spikes.learn_one(values[1])
                    else:
                        spikes.learn(values[1:])
            self.watch.resolve(item, found)
        if streak:
            raise self.counters.streak_error(self._dtype)

    def forget_pending(self) -> None:
        """Drop unread verdicts (a checkpoint replaces the windows they belong to)."""
        self._mailbox.clear()
        self._pending = []
        self.watch.forget()

    @property
    def world(self) -> int:
        """Ranks in the default process group."""
        return self._guard.world

    def total_weight(self, window: Window) -> torch.Tensor:
        """A token-weighted window's total weight over all ranks (as :meth:`_factor` summed it)."""
        total = self._total
        return total if total is not None else cast(torch.Tensor, window.weight)

    def clip(self) -> torch.Tensor:
        """Clip the total gradient norm of :meth:`params`; the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.params(), cast(float, self.max_grad_norm))
        return local(norm)

    # ------------------------------------------------------------------ parts

    def _close(self, window: Window) -> None:
        self._total = None
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
            total = self._total = window.weight.clone()
            world = self._guard.world
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
            grads = [local(g) for g in self.grads()]
            if grads:
                torch._foreach_mul_(grads, factor)
        return factor

    def _scaler_flags(
        self,
        scaler: torch.amp.GradScaler,
        checks: list[torch.Tensor],
        factor: torch.Tensor | float | None,
    ) -> list[dict[torch.device, torch.Tensor]] | None:
        """The scaler's per-optimizer inf flags (set by ``unscale_``); None if it keeps none.

        Without them the gradients are added to ``checks``; a token weight's factor
        (applied after the scaler's check) is always added. So are sparse gradients other
        than fp16 ones: ``unscale_`` checks their values as stored (it coalesces fp16 ones
        only), and duplicate entries can be finite while their sum, the gradient the
        optimizer sees, overflows; the guard checks them coalesced.
        """
        found: list[dict[torch.device, torch.Tensor]] = []
        states = getattr(scaler, "_per_optimizer_states", {})
        for opt in self.optimizers:
            flags = states.get(id(opt), {}).get("found_inf_per_device")
            if not flags:
                checks.extend(local(g) for g in self.grads())
                found = []
                break
            found.append(flags)
        if found:
            checks.extend(g for g in self.grads() if g.is_sparse and g.dtype != torch.float16)
        if isinstance(factor, torch.Tensor):
            checks.append(factor)
        return found or None

    def _decide_skip(
        self,
        window: Window,
        scaler: torch.amp.GradScaler | None,
        grad_norm: torch.Tensor | None,
        factor: torch.Tensor | float | None,
        ride: torch.Tensor | None = None,
    ) -> tuple[bool, torch.Tensor | None]:
        """Did any rank see a non-finite loss or gradient? One host read per optimizer step.

        Returns the answer and ``ride`` (a spike rule's loss share) summed over ranks by the
        same all-reduce (see :meth:`NonFiniteGuard.combine`).

        The window's losses are checked together with either the scaler's own verdict
        (fp16: ``unscale_`` already checked every gradient), the clipping norm (when
        clipping computed it), or the gradients themselves, in one fused kernel. Only
        when the clipping norm is non-finite does a second, exact check run: it tells
        inf/NaN gradients from finite ones whose norm overflowed, which the hand-written
        loop would clip to zero and step on.
        """
        guard = self._guard
        scaler_found: list[dict[torch.device, torch.Tensor]] | None = None
        if scaler is None and grad_norm is None:  # the usual guard: losses and gradients
            checks = window.losses + self.grads()
        else:
            checks = list(window.losses) if self.skip_nonfinite else []
        if scaler is not None:
            scaler_found = self._scaler_flags(scaler, checks, factor)
        elif grad_norm is not None:
            checks.append(grad_norm)
        clean = False
        try:
            verdict, ride = guard.combine(guard.check(checks), scaler_found, ride)
            skipped = verdict is not None and self._read(verdict)
            if skipped and grad_norm is not None:
                guard.reset()
                exact = [*window.losses, *self.grads()]
                verdict, _ = guard.combine(guard.check(exact))
                skipped = verdict is not None and self._read(verdict)
            clean = not skipped
            return skipped, ride
        finally:
            if not clean:
                guard.reset()

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
        watch = self.watch
        calls, seed = watch.take(window) if watch.locate else (None, None)
        try:
            factor = self._prepare(window, pending)
            verdict, grad_norm, posted, thresholds = self._verdict_on_device(window, scaler, factor)
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
            self._mailbox.post(posted)
            # The schedulers step now, as if the step was real (it almost always is), so
            # the learning rate and the schedulers' state are current for logging and
            # checkpoints; a skip found when the verdict is read puts them back.
            undo = SchedulerUndo(self.schedulers, self.optimizers)
            item = Pending(undo, posted, thresholds, calls, seed)
            self._pending.append(item)
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

    def _compiled_region(
        self, checks: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """With ``compile=``: the exact check of ``checks`` (and clipping), compiled as one.

        Returns the flag (> 0: an inf/NaN) and the clipping norm; None where the region
        does not apply: no ``compile=``, nothing to check, sharded (DTensor) gradients.
        """
        compiled = self._compiled_check
        if compiled is None or not checks or not _plain(checks):
            return None
        clip = self.max_grad_norm
        params = self.params() if clip else None
        if params is not None and not _plain(params):  # fp16 checks no gradients itself
            return None
        flag, one = self._guard.primary(checks[0].device)
        grad_norm = compiled(checks, flag, one, params, clip)
        return flag, grad_norm

    def _verdict_on_device(
        self,
        window: Window,
        scaler: torch.amp.GradScaler | None,
        factor: torch.Tensor | float | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple[float, ...]]:
        """The window's verdict as a fresh tensor (> 0: skip), and the clipping norm.

        With a spike rule, the verdict (0 or 1) joins the spike test, and the tensor to
        post holds the non-finite verdict and the statistics; with the thresholds used.
        Without one, the verdict itself is posted.
        """
        guard = self._guard
        watch = self.watch
        ride = watch.ride(window) if watch.spikes is not None else None
        checks = list(window.losses) if self.skip_nonfinite else []
        scaler_found = self._scaler_flags(scaler, checks, factor) if scaler is not None else None
        if scaler is None:
            checks.extend(self.grads())
        if (
            scaler is None
            and self._compiled_judge is not None
            and watch.spikes is not None
            and self.world == 1
        ):
            judged = self._judged_in_region(window, checks, ride)
            if judged is not None:
                return judged
        try:
            found: torch.Tensor | None
            compiled = self._compiled_region(checks)
            if compiled is not None:
                found, grad_norm = compiled
            else:
                found = guard.check(checks)
                grad_norm = self.clip() if self.max_grad_norm is not None else None
            verdict, ride = guard.combine(found, scaler_found, ride)
            if verdict is None:  # nothing to check: a step that cannot go wrong
                verdict = torch.zeros(1, device=self.params()[0].device)
            if watch.spikes is None:
                verdict = verdict.clone()
                return verdict, grad_norm, verdict, ()
            if scaler_found:  # found_inf must be 0 or 1 (fused optimizers subtract it)
                verdict = verdict.clamp(max=1)
            values = watch.values(window, ride, grad_norm, self)
            skip, posted, thresholds = watch.judge_device(verdict, values)
            return skip, grad_norm, posted, thresholds
        finally:
            guard.reset()  # the flags are zero again for the next window

    def _judged_in_region(
        self, window: Window, checks: list[torch.Tensor], ride: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple[float, ...]] | None:
        """:meth:`_verdict_on_device` with the spike test inside the compiled region.

        None where the region does not apply (nothing to check, sharded gradients).
        """
        params = self.params()
        if not checks or not _plain(checks) or not _plain(params):
            return None
        spikes = cast(SpikeWatch, self.watch.spikes)
        loss = self.watch.loss_statistic(window, ride, self) if "loss" in spikes.on else None
        flag, one = self._guard.primary(checks[0].device)
        judge = cast(Callable[..., Any], self._compiled_judge)
        try:
            norm, skip, posted = judge(
                checks,
                flag,
                one,
                params,
                self.max_grad_norm,
                loss,
                "grad_norm" in spikes.on,
                spikes.thresholds(),
            )
        finally:
            self._guard.reset()  # the flags are zero again for the next window
        return skip, norm, posted, spikes.thresholds()


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(tensors: list[torch.Tensor]) -> bool:
    """Dense real tensors and parameters, no subclass (DTensor): what the compiled region takes."""
    return all(type(t) in _PLAIN_TYPES and not t.is_sparse and not t.is_complex() for t in tensors)


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
