"""What a step watches besides inf/NaN: loss spikes (``skip_spikes=``) and where an inf/NaN
came from (``locate_nonfinite=True``).

:class:`Watch` is the judge's part: the spike rule's statistics of a window (as
tensors, then as the host's numbers), and the micro-batches a skipped window replays,
recorded around a decorated step function (:meth:`Watch.wrap`).
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch.amp.grad_scaler import OptState

from .._check import check_int
from .._dist import group_world_size
from ._ops import step_on_device
from .locate import Call, NonFiniteSource, NonFiniteWarning, replay
from .spikes import (
    SpikeRule,
    SpikeWatch,
    check_state,
    read_float,
)

if TYPE_CHECKING:
    from ._args import StepConfig
    from ._counters import StepCounters
    from ._params import StepParams
    from ._window import GradSync, Window

__all__ = [
    "Pending",
    "PendingSource",
    "Watch",
    "WatchOptions",
    "scaler_step_on_device",
]


class WatchOptions(TypedDict, total=False):
    """The watching options of :class:`~cudakit.amp.AutocastStep`, among its
    :class:`~cudakit.amp.step.StepOptions`.

    The same keywords as :func:`~cudakit.amp.autocast_step` takes, described there:
    ``skip_spikes`` (loss-spike skipping) and ``locate_nonfinite`` (naming the first
    producer of an inf/NaN).
    """

    skip_spikes: bool | str | SpikeRule | None
    locate_nonfinite: bool


class Pending:
    """A sync-free window whose verdict is not read yet: what reading it must do."""

    __slots__ = ("calls", "found", "seed", "source", "thresholds", "undo", "values")

    def __init__(
        self,
        undo: Any,
        values: torch.Tensor,
        thresholds: tuple[float, ...],
        calls: list[Call] | None,
        seed: Any,
    ) -> None:
        self.undo = undo  # the schedulers' state before their optimistic step
        self.values = values  # [non-finite verdict, statistics...] on the device
        self.thresholds = thresholds
        self.calls = calls  # the window's micro-batches (locate_nonfinite=True)
        self.seed = seed
        self.found: bool | None = None  # the verdict, once read
        self.source: NonFiniteSource | None = None


class PendingSource:
    """``StepResult.nonfinite`` of a sync-free step: located when you read it.

    Reading it (``bool()``, an attribute, ``repr()``) reads the window's verdict (a
    wait, like ``.item()``) and, for a window skipped for an inf/NaN, replays it, unless
    the step already did when it read the verdict. False when there is nothing to name.
    """

    __slots__ = ("_pending", "_watch")

    def __init__(self, pending: Pending, watch: Watch) -> None:
        self._pending = pending
        self._watch = watch

    def get(self) -> NonFiniteSource | None:
        """The source, or None."""
        pending = self._pending
        if pending.found is None:
            self._watch.resolve(pending, pending.values.reshape(-1)[0].item() > 0)
        return pending.source

    def __bool__(self) -> bool:
        return self.get() is not None

    def __eq__(self, other: object) -> bool:
        return self.get() == other

    def __hash__(self) -> int:
        return hash(self.get())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def __repr__(self) -> str:
        return repr(self.get())


class Watch:
    """The judge's spike rule and micro-batch record."""

    def __init__(self, config: StepConfig) -> None:
        rule, locate = config.skip_spikes, config.locate_nonfinite
        #: The spike rule and its statistics, or None (``skip_spikes`` off).
        self.spikes: SpikeWatch | None = SpikeWatch(rule) if rule is not None else None
        self.rule: SpikeRule | None = rule
        self._loss = rule is not None and "loss" in rule.on
        self._only_loss = rule is not None and rule.on == ("loss",)
        self._norm = rule is not None and "grad_norm" in rule.on
        self.locate = locate
        self._calls: list[Call] = []
        self._autocast: Callable[[], Any] | None = None
        self._pause: Callable[[], Any] | None = None
        self._root: Any = None

    # ------------------------------------------------------------------ micro-batches

    def record(self, func: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """``wrapper`` (a decorated step), recording each call's arguments for a replay."""
        calls = self._calls

        @functools.wraps(wrapper)
        def recording(*args: Any, **kwargs: Any) -> Any:
            calls.append((func, args, kwargs))
            return wrapper(*args, **kwargs)

        return recording

    def wrap(
        self,
        func: Callable[..., Any],
        wrapper: Callable[..., Any],
        sync: GradSync,
        autocast: Callable[[], Any],
    ) -> Callable[..., Any]:
        """The decorated ``wrapper``, recording its calls when ``locate_nonfinite`` is on.

        A replay runs its forward under the step's ``autocast`` and ``sync``'s pause
        (DDP's ``no_sync``); the model (``model=``) names the modules.
        """
        if not self.locate:
            return wrapper
        if sync.kind == "fsdp":
            raise ValueError(
                "autocast_step(locate_nonfinite=True) cannot replay an FSDP2 model: its "
                "forward and backward change state inside FSDP2 that nothing can put back. "
                "Find the source on one process without FSDP2, or call "
                "cudakit.amp.find_nonfinite(fn, *batch) on an unsharded copy."
            )
        self._autocast = autocast
        self._pause = sync.paused if sync.active else None
        self._root = sync.model if isinstance(sync.model, torch.nn.Module) else None
        return self.record(func, wrapper)

    def take(self, window: Window) -> tuple[list[Call], Any]:
        """The window's micro-batches (the last ``position`` recorded calls) and what its
        backward started from: ``(loss scale or None, accumulate)``; the record empties.
        """
        count = window.position
        calls, self._calls[:] = self._calls[-count:] if count else [], []
        accumulate = 1 if window.weighted else window.accumulate
        return calls, (window.scale, accumulate)

    def forget(self) -> None:
        """Drop recorded calls (a checkpoint replaced the window)."""
        self._calls.clear()

    def resolve(self, pending: Pending, found: bool) -> None:
        """The verdict of ``pending`` is known: for an inf/NaN, replay its micro-batches once."""
        if pending.found is not None:
            return
        pending.found = found
        if found and pending.calls is not None:
            pending.source = self.locate_now(pending.calls, pending.seed)
        pending.calls = None  # the micro-batches are no longer needed

    def locate_now(self, calls: Sequence[Call], seed: Any) -> NonFiniteSource | None:
        """Replay a skipped window's micro-batches; warn with what was found."""
        if not calls:
            warnings.warn(
                "autocast_step(locate_nonfinite=True) skipped a window for an inf/NaN but "
                "cannot replay it: its losses came through step.backward(loss), not a "
                "decorated step function. Call cudakit.amp.find_nonfinite(fn, *batch) on "
                "the batch yourself.",
                NonFiniteWarning,
                stacklevel=4,
            )
            return None
        scale, accumulate = seed
        scale = 1.0 if scale is None else float(scale)  # a read, made only for a replay
        try:
            # Without the loss scale: an inf that only the scale makes is the scaler's
            # routine overflow (it lowers the scale and goes on), not a producer to name.
            source = self._replay(calls, 1.0 / accumulate)
            scaled = source is None and scale != 1.0
            if scaled and self._replay(calls, scale / accumulate) is not None:
                warnings.warn(
                    f"autocast_step skipped a window whose inf/NaN only the loss scale made: "
                    f"replayed at scale {scale:g} its gradients overflow, at scale 1 they stay "
                    "finite. This is the GradScaler's routine back-off (it lowered the "
                    "scale); no module is at fault.",
                    NonFiniteWarning,
                    stacklevel=4,
                )
                return None
        except Exception as exc:  # the replay is a report: it never stops training
            warnings.warn(
                f"autocast_step(locate_nonfinite=True) skipped a window for an inf/NaN; "
                f"replaying it raised {type(exc).__name__}: {exc}",
                NonFiniteWarning,
                stacklevel=4,
            )
            return None
        if source is None:
            message = (
                "autocast_step skipped a window for an inf/NaN, but a replay of its "
                f"{len(calls)} micro-batch(es) stayed finite"
                + (
                    " on this rank: another rank's batch made it (every rank skips the "
                    "window together)."
                    if group_world_size() > 1
                    else ": the gradients overflowed only when summed over the window, or "
                    "the data changed since the step."
                )
            )
        else:
            message = f"autocast_step skipped a window for an inf/NaN; the first came from {source}"
        warnings.warn(message, NonFiniteWarning, stacklevel=4)
        return source

    def _replay(self, calls: Sequence[Call], seed: float) -> NonFiniteSource | None:
        return replay(calls, autocast=self._autocast, seed=seed, pause=self._pause, root=self._root)

    # ------------------------------------------------------------------ checkpoints

    def state(self, counters: StepCounters) -> dict[str, Any]:
        """The spike counters and running statistics, for ``AutocastStep.state_dict()``."""
        return {
            "spike_steps": counters.spikes,
            "consecutive_spikes": counters.consecutive_spikes,
            "spike_stats": self.spikes.state() if self.spikes is not None else {},
        }

    def check_state(self, state: Mapping[str, Any]) -> Callable[[StepCounters], None]:
        """Check this part of a state whole (absent in older checkpoints); how to apply it."""
        spikes = _count(state, "spike_steps")
        streak = _count(state, "consecutive_spikes")
        skipped = state.get("skipped_steps", 0)
        consecutive = state.get("consecutive_skipped", 0)
        if spikes > skipped or streak > min(spikes, consecutive):
            raise ValueError(
                f"AutocastStep.load_state_dict(): state['spike_steps']={spikes} and "
                f"state['consecutive_spikes']={streak} must not exceed the skipped steps "
                f"they are part of (skipped_steps={skipped}, consecutive_skipped="
                f"{consecutive}). Pass the dict returned by AutocastStep.state_dict(), "
                "unchanged."
            )
        stats = check_state(state.get("spike_stats", {}))

        def apply(counters: StepCounters) -> None:
            counters.spikes, counters.consecutive_spikes = spikes, streak
            if self.spikes is not None:  # statistics this rule does not watch are ignored
                self.spikes.restore(stats)

        return apply

    # ------------------------------------------------------------------ spike statistics

    def ride(self, window: Window) -> torch.Tensor | None:
        """This rank's share of the window loss, for the guard's all-reduce (or None)."""
        losses = window.losses
        if not self._loss or not losses:
            return None
        if len(losses) == 1 and losses[0].dtype is torch.float32:
            return losses[0]  # the common case, without a call
        return SpikeWatch.local_loss(losses, bool(window.weighted))

    def loss_statistic(
        self, window: Window, ride: torch.Tensor | None, params: StepParams, world: int
    ) -> torch.Tensor:
        """The window's loss as the rule watches it: over its micro-batches and ranks."""
        x = ride if ride is not None else torch.zeros((), device=params.params()[0].device)
        if window.weighted:
            return x / window.total_weight()
        if world > 1:
            return x / world
        return x

    def values(
        self,
        window: Window,
        ride: torch.Tensor | None,
        grad_norm: torch.Tensor | None,
        params: StepParams,
        world: int,
    ) -> list[torch.Tensor]:
        """The watched statistics of the window as float32 tensors, in rule order."""
        out: list[torch.Tensor] = []
        if self._loss:
            out.append(self.loss_statistic(window, ride, params, world))
        if self._norm:
            if grad_norm is None:
                grad_norm = SpikeWatch.grad_norm(params.grads())
            out.append(grad_norm if grad_norm.dtype is torch.float32 else grad_norm.float())
        return out

    def judge_host(
        self,
        window: Window,
        ride: torch.Tensor | None,
        grad_norm: torch.Tensor | None,
        params: StepParams,
        world: int,
    ) -> list[float] | None:
        """Read the window's statistics (from memory on the CPU) and judge them.

        Returns None for a spike, else the numbers to learn once the window has stepped.
        """
        spikes: SpikeWatch = self.spikes  # type: ignore[assignment]  # (a rule is set: no call)
        if self._only_loss and ride is not None and window.weighted is not True:
            losses = window.losses
            # One float32 loss, not reduced across ranks (the guard returned it as it was):
            # the statistic is that loss itself, read without a torch op.
            if len(losses) == 1 and ride is losses[0] and ride.is_cpu:
                x = ctypes.c_float.from_address(ride.data_ptr()).value
                return None if x > spikes._levels[0] else [x]
        numbers = [read_float(x) for x in self.values(window, ride, grad_norm, params, world)]
        return None if spikes.is_spike(numbers, spikes._levels) else numbers

    def judge_device(
        self, verdict: torch.Tensor, values: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[float, ...]]:
        """On the device: (skip flag 0/1, [verdict, statistics...] to post, thresholds)."""
        spikes = self.spikes
        assert spikes is not None
        return spikes.judge(verdict, values)


def _count(state: Mapping[str, Any], key: str) -> int:
    return check_int(
        "AutocastStep.load_state_dict",
        f"state[{key!r}]",
        state.get(key, 0),
        minimum=0,
        fix="Pass the dict returned by AutocastStep.state_dict(), unchanged.",
    )


def scaler_step_on_device(
    scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, skip: torch.Tensor
) -> None:
    """``scaler.step(opt)`` of an unscaled fused optimizer, skipping on ``skip`` (spikes too)."""
    step_on_device(opt, skip)
    scaler._per_optimizer_states[id(opt)]["stage"] = OptState.STEPPED
