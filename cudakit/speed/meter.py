"""The throughput meter :class:`SpeedMeter`, which :func:`~cudakit.speed.speed_report` makes.

A meter is a ``with`` block, a decorator, and an object reused across a loop, as
:func:`~cudakit.memory_report` is. Each call adds a record to the meter's
:class:`~cudakit.speed._recorder.Recorder` (shared by its clones and the functions it
decorates) and reads nothing from the device; the figures
are read at the log interval (``every=``) or when an attribute is, and combined
across ranks only at the log interval.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import torch
from typing_extensions import ParamSpec

from .._check import check_callable, check_int, fail_type, fail_value, is_real
from .._contextlib import ContextDecorator, reject_deferred_body
from .._deprecated import renamed
from ._args import Settings, step_of
from ._clock import WallClock
from ._recorder import Recorder
from .counts import Count, check_count
from .figures import SpeedFigures, SpeedSummary
from .flops import batch_of, batch_position
from .peaks import Peak

__all__ = ["SpeedMeter", "SpeedReported"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class SpeedReported(Protocol[P, R_co]):
    """A function decorated with :func:`speed_report`: ``fn.speed_report`` is the meter.

    .. versionadded:: 0.1
    """

    speed_report: SpeedMeter
    __name__: str
    __qualname__: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...


class SpeedMeter(ContextDecorator):
    """Measures the calls of a step (``with``, ``@``); see :func:`speed_report`.

    One object measures one call at a time; it may be entered again and again (a
    ``with`` inside a loop). :meth:`measure` gives a clone for one batch, and the
    decorator measures each call into the same figures. Like the ``autocast_step`` it
    measures, a meter belongs to one training loop: its hot path takes no lock, so it
    is not shared between threads (recursion is fine: each call keeps its own start).

    >>> from cudakit.speed import speed_report
    >>> meter = speed_report(samples=32, flops=1e9, peak_tflops=1.0, file=None)
    >>> for _ in range(3):
    ...     with meter:
    ...         pass
    >>> meter.steps, meter.recent.samples, meter.mfu is not None, meter.mfu_reason
    (3, 96.0, True, None)

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        settings: Settings,
        recorder: Recorder | None = None,
        batch: Any = ...,
        counts: tuple[Count | None, Count | None] = (None, None),
    ) -> None:
        self._settings = settings
        self._recorder = recorder if recorder is not None else Recorder(settings)
        self._batch = batch
        self._counts = counts
        self._open: Any = None
        self._before = 0
        self._counted: tuple[Count, Count, Count] = (0, 0, 0)

    @property
    def label(self) -> str | None:
        """The name in the log line (a decorator's default: the function's name)."""
        return self._recorder.label

    def clone(self) -> Self:
        """A fresh, un-entered meter with the same settings, adding to the same figures."""
        return type(self)(self._settings, self._recorder, self._batch, self._counts)

    def measure(
        self, batch: Any = ..., *, samples: Count | None = None, tokens: Count | None = None
    ) -> Self:
        """A ``with`` block for one call on ``batch``, or with the counts given.

        >>> from cudakit.speed import speed_report
        >>> meter = speed_report(samples=len, file=None)
        >>> with meter.measure([1, 2, 3]):
        ...     pass
        >>> with meter.measure(samples=5):
        ...     pass
        >>> meter.total.samples
        8.0

        Args:
            batch: the call's batch, for ``samples=``/``tokens=``/``flops=`` functions;
                left out (``...``) when the block is given its counts instead.
            samples: this call's samples (a number or a one-element tensor), instead
                of ``samples=``'s.
            tokens: this call's tokens, instead of ``tokens=``'s.

        Raises:
            TypeError, ValueError: a count that is not a number >= 0 or a one-element
                tensor.
        """
        given: tuple[Count | None, Count | None] = (None, None)
        if samples is not None or tokens is not None:
            given = (
                None if samples is None else check_count("samples", samples),
                None if tokens is None else check_count("tokens", tokens),
            )
        return type(self)(self._settings, self._recorder, batch, given)

    def __enter__(self) -> Self:
        if self._open is not None:
            raise RuntimeError(
                f"this speed_report({self.label or ''!r}) is already measuring a call; one "
                "object measures one call at a time. For a nested block use "
                "meter.measure(...) or a new speed_report()."
            )
        if self._batch is ...:  # no batch given: the counts must come from elsewhere
            missing = self._settings.counter.missing(*self._counts)
            if missing:
                raise RuntimeError(
                    f"speed_report({', '.join(missing)}) counts from the batch, but this "
                    "block was given none: write `with meter.measure(batch):`, or pass "
                    "the counts, e.g. `with meter.measure(samples=64):`."
                )
        recorder = self._recorder
        counter = self._settings.counter
        try:  # before the block runs: a count that fails leaves the block unrun
            self._counted = counter.count(self._batch, *self._counts)
        except Exception as exc:
            counter.explain(exc, self._batch, "the block's batch", self._counts)
            raise
        step = recorder.step
        self._before = recorder.window.position if step is not None else 0  # (no property)
        self._open = recorder.tally.clock.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        start = self._open
        if start is None:
            raise RuntimeError(
                "speed_report.__exit__ called without __enter__; use `with meter:` or "
                "`with meter.measure(batch):`."
            )
        self._open = None
        if exc_type is not None:
            return  # a failed call is not a step: nothing is counted
        recorder = self._recorder
        mark = recorder.tally.clock.stop(start)
        recorder.record(mark, self._counted, None, self._before, recorder.step)

    def __call__(self, func: Callable[P, R]) -> SpeedReported[P, R]:
        """Decorate ``func``: every call is measured; its first argument is the batch.

        A method's batch is the argument after ``self`` (or ``cls``): the first
        parameter's name says which.
        """
        check_callable(
            "speed_report",
            "func",
            func,
            expected="a function to decorate",
            fix="Write `@speed_report(...)` above a `def`, or `with meter:` around a block.",
        )
        reject_deferred_body(
            func,
            "speed_report cannot decorate",
            "Put `with meter.measure(batch):` around the step inside the function instead.",
        )
        settings = self._settings
        recorder = self._recorder
        step = settings.step or step_of(func)
        if step is not None and settings.accumulate is not None:
            raise ValueError(
                f"speed_report(accumulate={settings.accumulate}) decorates "
                f"{getattr(func, '__qualname__', func)!r}, an autocast_step function whose "
                "windows the meter reads from the step. Drop accumulate=."
            )
        if recorder.label is None:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
            if name is not None:
                recorder.label = str(name).rsplit("<locals>.", 1)[-1]
        if recorder.step is None:
            recorder.step = step  # its dtype picks the peak
            recorder.window = step.window if step is not None else None
        tally = recorder.tally
        start, stop = tally.clock.start, tally.clock.stop
        counter = settings.counter
        count = counter.of_batch()
        fixed = None if counter.needs_batch else counter.count(None)
        skip = batch_position(func)

        def failed(exc: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            where = "the batch of " + (recorder.label or "the function")
            where += " (its argument after self)" if skip else " (its first argument)"
            counter.explain(exc, batch_of(args, kwargs, skip), where)

        if step is None:
            record = recorder.record

            @functools.wraps(func)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                try:  # counted first: a count that fails leaves the step unrun
                    counts = fixed or count(
                        args[skip] if len(args) > skip else batch_of(args, kwargs, skip)
                    )
                except Exception as exc:
                    failed(exc, args, kwargs)
                    raise
                mark = start()
                out = func(*args, **kwargs)
                mark = stop(mark)
                record(mark, counts, out, 0, None)
                return out

        else:  # the common case, kept lean: the step's windows are the optimizer steps
            add, log, every = tally.add, recorder.log, settings.every
            end_flushed = recorder.end_flushed
            window = step.window  # bound once: its position is read without a property call
            # The wall clock's stop is a subtraction: made here, not through a call.
            wall = time.perf_counter if type(tally.clock) is WallClock else None

            @functools.wraps(func)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                try:  # counted first: a count that fails leaves the step unrun
                    s, t, f = fixed or count(
                        args[skip] if len(args) > skip else batch_of(args, kwargs, skip)
                    )
                except Exception as exc:
                    failed(exc, args, kwargs)
                    raise
                before = window.position
                if wall is not None:
                    t0 = wall()
                    out = func(*args, **kwargs)
                    mark: Any = wall() - t0
                else:
                    mark = start()
                    out = func(*args, **kwargs)
                    mark = stop(mark)
                if before == 0 and (tally.open_calls or recorder.due):
                    end_flushed()  # the window was stepped between calls (flush())
                if add(mark, s, t, f, window.position == 0) and every and tally.steps % every == 0:
                    log(out)
                return out

        wrapped: Any = wrapper
        wrapped.speed_report = self
        return wrapped  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ figures

    @property
    def calls(self) -> int:
        """Calls (micro-batches) measured so far; no read of the device."""
        return self._recorder.tally.calls

    @property
    def steps(self) -> int:
        """Optimizer steps (closed accumulation windows) measured so far; no read.

        The line's step counts on from ``start=`` (see :meth:`state_dict`); this counts
        the steps this meter measured.
        """
        self._recorder.close_flushed()
        tally = self._recorder.tally
        return tally.steps - tally.start

    # ------------------------------------------------------------------ the line's extras

    def show(self, **values: Any) -> None:
        """Put ``values`` in the line (``loss 2.314, ...``), read only when it is written.

        Each value is a number, a one-element tensor (kept as it is: no read of the
        device here) or a function that returns one (called for the line). A name
        shown again replaces its value; the line shows the last one given. A line is
        written at the end of the call (or block) that reaches its step: show this
        step's loss inside the ``with`` block, or pass ``speed_report(loss=True)`` to a
        decorator (a value shown after the call is the next line's).

        >>> from cudakit.speed import speed_report
        >>> meter = speed_report(every=None, file=None)
        >>> with meter:
        ...     loss = torch.tensor(2.5)
        >>> meter.show(loss=loss, lr=lambda: 3e-4)
        >>> meter.flush()
        >>> meter.last_line.split(",")[:2]
        ['speed_report cpu step 1: loss 2.5', ' lr 0.0003']

        Raises:
            TypeError, ValueError: a value that is not a number, a one-element tensor
                or a function; nothing shown changes then.

        .. versionadded:: 0.1
        """
        for name, value in values.items():
            _check_shown(name, value)
        self._recorder.shown.update(values)

    @property
    def shown(self) -> dict[str, float]:
        """The values given to :meth:`show`, read now (a tensor from its device)."""
        return self._recorder.read_shown()

    def state_dict(self) -> dict[str, int]:
        """The meter's count, for a checkpoint: ``{"step": optimizer steps so far}``.

        A meter passed to :class:`~cudakit.Checkpointer` in ``extra=`` is saved with
        each checkpoint, and a resumed run's line counts on from its position.

        >>> from cudakit.speed import speed_report
        >>> meter = speed_report(start=30, file=None)
        >>> meter.state_dict()
        {'step': 30}

        .. versionadded:: 0.1
        """
        self._recorder.close_flushed()
        return {"step": self._recorder.tally.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Count on from the step of ``state`` (from :meth:`state_dict`); figures stay.

        Raises:
            TypeError, ValueError: not such a dict; the meter is unchanged then.

        .. versionadded:: 0.1
        """
        func = "SpeedMeter.load_state_dict"
        expected = "a dict from SpeedMeter.state_dict() such as {'step': 3}"
        if not isinstance(state, Mapping):
            fail_type(func, "state", expected, state)
        if set(state) != {"step"}:
            fail_value(func, "state", expected, state, f"It has the keys {sorted(state)}.")
        step = check_int(func, "step", state["step"], minimum=0, fix="")
        self._recorder.close_flushed()
        self._recorder.move_to(step)

    def summary(self) -> SpeedSummary:
        """This rank's rolling window and totals now (reads what is pending, no collective)."""
        return self._recorder.summary()

    @property
    def recent(self) -> SpeedFigures:
        """Figures of the last ``window`` optimizer steps, on this rank."""
        return self.summary().recent

    @property
    def total(self) -> SpeedFigures:
        """Figures of every optimizer step so far, on this rank."""
        return self.summary().total

    @property
    def combined(self) -> SpeedSummary | None:
        """Every rank's figures at the last log line; None before one, or without a group."""
        return self._recorder.combined

    @property
    def last_line(self) -> str | None:
        """The last line written (also when ``file=None``), or None."""
        return self._recorder.last_line

    @property
    def peak(self) -> Peak:
        """The peak the MFU is measured against, or the reason there is none."""
        return self._recorder.peak(self._recorder.step)

    @property
    def step_time(self) -> float | None:
        """Seconds per optimizer step over the rolling window."""
        return self.recent.step_time

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second over the rolling window."""
        return self.recent.samples_per_s

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second over the rolling window."""
        return self.recent.tokens_per_s

    @property
    def tflops(self) -> float | None:
        """Achieved TFLOP/s over the rolling window."""
        return self.recent.tflops

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation over the rolling window (0.45 is 45 %), or None."""
        return self.recent.mfu

    @property
    def mfu_reason(self) -> str | None:
        """Why :attr:`mfu` is None (no peak for this device, no FLOP count), else None."""
        return self.recent.mfu_reason

    def flush(self) -> None:
        """Write the line for the steps since the last one (combined: call it on every rank)."""
        recorder = self._recorder
        recorder.close_flushed()
        if recorder.tally.steps > recorder.logged_at:
            recorder.log()


def _check_shown(name: str, value: object) -> None:
    expected = "a number, a one-element tensor or a function that returns one"
    fix = "For example: meter.show(loss=loss), the loss tensor as it is."
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            fail_value(
                "SpeedMeter.show",
                name,
                expected,
                value,
                f"It has {value.numel()} elements: show one number, e.g. {name}=t.mean().",
            )
    elif not (callable(value) or is_real(value)):
        fail_type("SpeedMeter.show", name, expected, value, fix)


__getattr__ = renamed(__name__, {"SpeedReport": SpeedMeter})
