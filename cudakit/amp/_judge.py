"""The verdict on a closing window: does it step or skip?

:class:`WindowJudge` owns the non-finite guard (with the scaler's own inf flags or the
clipping norm where those already checked the gradients), the spike rule's test
(``skip_spikes=``) and, on the sync-free path, the verdicts posted to the device and
read lazily (:meth:`WindowJudge.settle`): one window later, or when a counter is read.
The optimizer step itself is :class:`~cudakit.amp._stepper.OptimizerStep`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from ._args import StepConfig
from ._compiling import captures_cuda_graphs, compile_fn
from ._counters import StepCounters
from ._guard import NonFiniteGuard, VerdictMailbox, local
from ._ops import check_and_clip, check_clip_and_judge
from ._params import StepParams
from ._window import Window
from .spikes import SpikeWatch
from .watch import Pending, Watch

__all__ = ["WindowJudge"]

#: (skip flag, clipping norm, tensor to post, thresholds) of a window judged on the device.
DeviceVerdict = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple[float, ...]]


class WindowJudge:
    """Whether a window steps: the guard, the spike rule, and the verdicts read lazily."""

    def __init__(
        self,
        config: StepConfig,
        counters: StepCounters,
        params: StepParams,
        *,
        sync_free: bool,
        lazy: bool,
    ) -> None:
        #: Loss spikes (``skip_spikes=``) and the replay of skipped windows (``locate_nonfinite=``).
        self.watch = Watch(config)
        self.counters = counters
        self.params = params
        self.skip_nonfinite = config.skip_nonfinite
        self._dtype = config.dtype
        #: Verdicts go to the optimizers on the device and are read lazily (see
        #: :class:`~cudakit.amp._stepper.OptimizerStep`).
        self.lazy = lazy
        self._guard = NonFiniteGuard()
        # A sync-free step on the CPU reads its verdict from memory, without a torch op;
        # other steps make their one read with .item() (measured a little faster there).
        self.read: Callable[[torch.Tensor], bool] = (
            NonFiniteGuard.read_memory if sync_free and not lazy else NonFiniteGuard.read
        )
        self._mailbox = VerdictMailbox()
        self._pending: list[Pending] = []  # one per posted verdict
        compile_options = config.compile_options
        # Compiled on the sync-free path with clipping only, where inductor fuses the
        # check, the norm and the scaling (a GPU's eager check is one fused kernel
        # already). Measured on the CPU, the compiled region cost more than the eager
        # check and clip (its guards alone check every tensor), so the CPU never uses it.
        self._compiled_check: Callable[..., torch.Tensor | None] | None = (
            compile_fn(check_and_clip, compile_options, fullgraph=True)
            if compile_options is not None and lazy and config.max_grad_norm is not None
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
            and not config.scaling
            and getattr(torch._dynamo.config, "specialize_float", True) is False
            and not captures_cuda_graphs(compile_options or {})
            else None
        )

    @property
    def world(self) -> int:
        """Ranks in the default process group."""
        return self._guard.world

    # ------------------------------------------------------------------ lazy verdicts

    def post(self, posted: torch.Tensor, item: Pending) -> None:
        """Keep a sync-free window's verdict (on the device) to read later."""
        self._mailbox.post(posted)
        self._pending.append(item)

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
                if len(values) == watched and spikes is not None:
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

    # ------------------------------------------------------------------ read on the host

    def judge_spike(
        self, window: Window, ride: torch.Tensor | None, grad_norm: torch.Tensor | None
    ) -> list[float] | None:
        """The spike rule's test, read on the host: None for a spike, else what to learn."""
        return self.watch.judge_host(window, ride, grad_norm, self.params, self._guard.world)

    def scaler_flags(
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
        grads = self.params.grads
        for opt in self.params.optimizers:
            flags = states.get(id(opt), {}).get("found_inf_per_device")
            if not flags:
                checks.extend(local(g) for g in grads())
                found = []
                break
            found.append(flags)
        if found:
            checks.extend(g for g in grads() if g.is_sparse and g.dtype != torch.float16)
        if isinstance(factor, torch.Tensor):
            checks.append(factor)
        return found or None

    def decide(
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
            checks = window.losses + self.params.grads()
        else:
            checks = list(window.losses) if self.skip_nonfinite else []
        if scaler is not None:
            scaler_found = self.scaler_flags(scaler, checks, factor)
        elif grad_norm is not None:
            checks.append(grad_norm)
        clean = False
        try:
            verdict, ride = guard.combine(guard.check(checks), scaler_found, ride)
            skipped = verdict is not None and self.read(verdict)
            if skipped and grad_norm is not None:
                guard.reset()
                exact = [*window.losses, *self.params.grads()]
                verdict, _ = guard.combine(guard.check(exact))
                skipped = verdict is not None and self.read(verdict)
            clean = not skipped
            return skipped, ride
        finally:
            if not clean:
                guard.reset()

    # ------------------------------------------------------------------ kept on the device

    def on_device(
        self,
        window: Window,
        scaler: torch.amp.GradScaler | None,
        factor: torch.Tensor | float | None,
    ) -> DeviceVerdict:
        """The window's verdict as a fresh tensor (> 0: skip), and the clipping norm.

        With a spike rule, the verdict (0 or 1) joins the spike test, and the tensor to
        post holds the non-finite verdict and the statistics; with the thresholds used.
        Without one, the verdict itself is posted.
        """
        guard = self._guard
        watch = self.watch
        params = self.params
        ride = watch.ride(window) if watch.spikes is not None else None
        checks = list(window.losses) if self.skip_nonfinite else []
        scaler_found = self.scaler_flags(scaler, checks, factor) if scaler is not None else None
        if scaler is None:
            checks.extend(params.grads())
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
                grad_norm = params.clip() if params.max_grad_norm is not None else None
            verdict, ride = guard.combine(found, scaler_found, ride)
            if verdict is None:  # nothing to check: a step that cannot go wrong
                verdict = torch.zeros(1, device=params.params()[0].device)
            if watch.spikes is None:
                verdict = verdict.clone()
                return verdict, grad_norm, verdict, ()
            if scaler_found:  # found_inf must be 0 or 1 (fused optimizers subtract it)
                verdict = verdict.clamp(max=1)
            values = watch.values(window, ride, grad_norm, params, self.world)
            skip, posted, thresholds = watch.judge_device(verdict, values)
            return skip, grad_norm, posted, thresholds
        finally:
            guard.reset()  # the flags are zero again for the next window

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
        clip = self.params.max_grad_norm
        params = self.params.clipped() if clip else None
        if params is not None and not _plain(params):  # fp16 checks no gradients itself
            return None
        flag, one = self._guard.primary(checks[0].device)
        grad_norm = compiled(checks, flag, one, params, clip)
        return flag, grad_norm

    def _judged_in_region(
        self, window: Window, checks: list[torch.Tensor], ride: torch.Tensor | None
    ) -> DeviceVerdict | None:
        """:meth:`on_device` with the spike test inside the compiled region.

        None where the region does not apply (nothing to check, sharded gradients).
        """
        params = self.params.clipped()
        if not checks or not _plain(checks) or not _plain(params):
            return None
        spikes = cast(SpikeWatch, self.watch.spikes)
        loss = (
            self.watch.loss_statistic(window, ride, self.params, self.world)
            if "loss" in spikes.on
            else None
        )
        flag, one = self._guard.primary(checks[0].device)
        judge = cast(Callable[..., Any], self._compiled_judge)
        try:
            norm, skip, posted = judge(
                checks,
                flag,
                one,
                params,
                self.params.max_grad_norm,
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
