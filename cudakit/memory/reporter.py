"""Measure a block or every call of a function: :func:`memory_report` and :class:`MemoryMeter`.

Nesting is safe (see ``_frames``). All bookkeeping is under one lock. Allocator
counters are global per device, so when reports on different threads overlap on
the same device their numbers include each other's allocations; such reports are
marked ``shared=True`` and say so in their text rather than being silently wrong.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from types import EllipsisType, TracebackType
from typing import IO, Any, Literal, Protocol, Self, TypeVar, overload

from typing_extensions import ParamSpec

from .._accel import follows_current_device
from .._check import check_choice, check_int, check_optional, check_type, fail_type
from .._contextlib import ContextDecorator
from .._deprecated import renamed
from .._oom import is_oom_error
from .._output import (
    STDERR,
    LogTarget,
    Stderr,
    check_file,
    check_log,
    describe_target,
    write_line,
)
from ..device import DeviceLike
from . import _probes
from ._frames import STACK, Frame
from ._notes import explain_oom
from ._targets import Target
from ._targets import targets as resolve_targets
from ._throttle import Throttle
from .results import DeviceMemory, MemoryReport, ReportFigures

__all__ = ["STDERR", "LogTarget", "MemoryMeter", "MemoryReported", "Stderr", "memory_report"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class MemoryReported(Protocol[P, R_co]):
    """A function decorated with :func:`memory_report`.

    ``fn.memory_report`` is the :class:`MemoryMeter`: ``.last`` is the most
    recent call's report, ``.calls`` the number of calls and ``.flush()``
    writes the pending aggregate line.

    >>> from cudakit.memory import memory_report
    >>> @memory_report(device="cpu", file=None)
    ... def step(n: int) -> int:
    ...     return n + 1
    >>> step(1), step(2), step.memory_report.calls, step.memory_report.last.label
    (2, 3, 2, 'step')

    .. versionadded:: 0.1
    """

    memory_report: MemoryMeter
    __name__: str
    __qualname__: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...


class MemoryMeter(ContextDecorator, ReportFigures):
    """Measures a block (``with``) or every call of a function (``@``); see :func:`memory_report`.

    One object may be entered many times one after the other (a ``with`` inside a
    loop); its output is throttled across those entries. Entering it again while
    it is open raises ``RuntimeError``: nest a new ``memory_report()`` instead.
    ``device=None``, ``"auto"`` and ``"cuda"`` follow the thread's current CUDA
    device at every entry, so an object made before ``torch.cuda.set_device``
    measures the right device.

    The numbers of the latest finished block are also read from the reporter itself:
    ``rep.peak_allocated`` is ``rep.last.peak_allocated`` (every figure of
    :class:`MemoryReport`, and :attr:`elapsed`, :attr:`raised`, :attr:`devices`).

    >>> from cudakit.memory import memory_report
    >>> step_memory = memory_report("step", device="cpu", file=None)
    >>> with step_memory:
    ...     pass
    >>> step_memory.peak_allocated == step_memory.last.peak_allocated
    True
    >>> lines = []
    >>> step_memory = memory_report("step", device="cpu", log=lines.append, every=2)
    >>> for _ in range(4):
    ...     with step_memory:
    ...         pass
    >>> step_memory.calls, len(lines), lines[0].startswith(
    ...     "memory_report 'step' cpu x2 calls"
    ... )
    (4, 2, True)

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        label: str | None,
        device: DeviceLike | Literal["all"],
        file: IO[str] | Stderr | None,
        log: LogTarget | None,
        every: int | None,
        record_history: str | os.PathLike[str] | None,
        stacks: Literal["python", "all"] = "python",
    ) -> None:
        self.label = label
        self._device = device
        self._file = file
        self._log = log
        self._every = every
        self._history = None if record_history is None else os.fspath(record_history)
        self._stacks = stacks
        self._targets = self._resolve()
        self._follow = follows_current_device(device)
        self._agg_: Throttle | None = None  # made on first use: most `with` reports never need it
        self._frames: list[Frame] | None = None
        self._report: MemoryReport | None = None
        self._t0 = 0.0

    def _resolve(self) -> tuple[Target, ...]:
        targets = resolve_targets(self._device, "memory_report")
        if self._history is not None and any(i < 0 for _, i in targets):
            raise ValueError(
                f"memory_report(record_history={self._history!r}) records the CUDA caching "
                f"allocator, but this report measures {targets[0][0]}. Pass a CUDA device "
                "(device='cuda'), or drop record_history on CPU-only machines."
            )
        return targets

    @property
    def _agg(self) -> Throttle:
        agg = self._agg_
        if agg is None:
            agg = self._agg_ = Throttle(self._every)
        return agg

    @property
    def last(self) -> MemoryReport | None:
        """The most recent finished report of this object (and its decorator clones)."""
        return self._agg.last

    def _latest(self) -> MemoryReport:
        """The latest finished report; ``RuntimeError`` while a block is open, or before one."""
        rep = self._report if self._report is not None else self._agg.last
        if rep is None:
            raise RuntimeError(
                f"memory_report({self.label or ''!r}) has not measured a block yet: its "
                "numbers exist once a `with` block (or a decorated call) has ended, e.g. "
                "`with rep: ...` then `rep.peak_allocated`. Use memory_snapshot() for the "
                "numbers now."
            )
        rep.figures()  # raises while the block is open, or when its numbers failed
        return rep

    def figures(self) -> DeviceMemory:
        """The latest finished block's figures (see :meth:`MemoryReport.figures`).

        .. versionadded:: 0.1
        """
        return self._latest().figures()

    @property
    def elapsed(self) -> float:
        """Seconds the latest finished block took."""
        return self._latest().elapsed

    @property
    def raised(self) -> str | None:
        """The exception the latest finished block raised, by name, or ``None``."""
        return self._latest().raised

    @property
    def devices(self) -> tuple[DeviceMemory, ...]:
        """One :class:`DeviceMemory` per device of the latest finished block."""
        return self._latest().devices

    @property
    def calls(self) -> int:
        """How many blocks or calls this object (and its clones) has measured."""
        return self._agg.calls

    def clone(self, label: str | EllipsisType | None = ...) -> Self:
        """A fresh, un-entered reporter with the same settings and the same output throttle.

        Args:
            label: The clone's label; ``...`` (the default) keeps this reporter's.
        """
        check_type(
            "MemoryMeter.clone",
            "label",
            label,
            (str, EllipsisType, type(None)),
            expected="a string naming the block, or None",
            fix="For example: rep.clone('eval_step').",
        )
        twin = copy.copy(self)  # the settings, the resolved targets, the throttle
        twin.label = self.label if isinstance(label, EllipsisType) else label
        twin._agg_ = self._agg  # shared: made now if it was not yet
        twin._frames = None
        twin._report = None
        twin._t0 = 0.0
        return twin

    def __call__(self, func: Callable[P, R]) -> MemoryReported[P, R]:
        """Decorate ``func``: every call is measured; output is throttled (see ``every``)."""
        target = self
        if self.label is None and callable(func):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
            target = self.clone(None if name is None else str(name).rsplit("<locals>.", 1)[-1])
        wrapped: Any = ContextDecorator.__call__(target, func)
        wrapped.memory_report = target
        return wrapped  # type: ignore[no-any-return]

    def __enter__(self) -> MemoryReport:
        targets = self._targets
        if self._follow and targets[0][1] >= 0:
            # device=None/"auto"/"cuda" follows this thread's current device, which may
            # have changed since decoration (torch.cuda.set_device(local_rank) in DDP).
            index = _probes.cuda.current_index()
            if index != targets[0][1]:
                targets = self._targets = ((f"cuda:{index}", index),)
        rep = MemoryReport(self.label)
        stack = STACK
        with stack.lock:
            if self._frames is not None:
                raise RuntimeError(
                    f"this memory_report({self.label or ''!r}) is already open; one object "
                    "measures one block at a time. For a nested block write a new "
                    "`with memory_report(...)`, or decorate the function with @memory_report."
                )
            frames: list[Frame] = []
            recording = False
            try:
                if self._history is not None:
                    running = stack.history_stacks if stack.history_depth else None
                    if running is not None and running != self._stacks:
                        raise RuntimeError(
                            f"memory_report({self.label or ''!r}, stacks={self._stacks!r}) is "
                            "nested in a report that records the allocator history with "
                            f"stacks={running!r}; one recording serves both, so give the nested "
                            f"report stacks={running!r} too (or end the outer report first)."
                        )
                    stack.begin_history(self._stacks)
                    recording = True
                for name, index in targets:
                    frames.append(stack.push(name, index))
            except BaseException:
                stack.discard(frames)  # leave no half-opened report behind
                if recording:
                    stack.end_history()
                raise
            self._frames = frames
        self._report = rep
        self._t0 = time.perf_counter()
        return rep

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        elapsed = time.perf_counter() - self._t0
        frames, rep = self._frames, self._report
        if frames is None or rep is None:
            raise RuntimeError(
                "memory_report.__exit__ called without __enter__; use `with memory_report():`."
            )
        read_error: BaseException | None = None
        history_error: BaseException | None = None
        devices: list[DeviceMemory] = []
        stack = STACK
        with stack.lock:
            self._frames = None
            self._report = None
            for f in frames:  # pop() unregisters the frame before it reads anything
                try:
                    devices.append(stack.pop(f))
                except Exception as e:  # e.g. a sticky CUDA error after a device-side assert
                    read_error = read_error or e
            if self._history is not None:
                try:
                    _probes.cuda.dump_history(self._history)
                except Exception as e:  # report the block anyway, then raise below
                    history_error = e
                finally:
                    stack.end_history()
        if read_error is not None:
            rep.failed = f"{type(read_error).__name__}: {read_error}"
            msg = (
                f"memory_report {rep.label or ''!r} has no numbers: reading the memory "
                f"counters failed with {rep.failed}"
            )
            if exc is None:
                raise RuntimeError(msg) from read_error
            exc.add_note(f"cudakit.{msg}")  # the block's own error goes on unchanged
            return
        rep.devices = tuple(devices)
        rep.elapsed = elapsed
        rep.raised = None if exc_type is None else exc_type.__qualname__
        rep.shared = any(f.shared for f in frames)
        rep.history = self._history if history_error is None else None
        rep.done = True
        if exc is not None and is_oom_error(exc):
            explain_oom(exc, rep)
        write_error: Exception | None = None
        if self._file is None and self._log is None:
            self._agg.count(rep)  # silent: keep .last and .calls, format nothing
        else:
            line = self._agg.add(rep)
            if line is not None:
                try:
                    self._write(line)
                except Exception as e:  # a full disk, a closed file: the block's error first
                    write_error = e
        write_msg = (
            None
            if write_error is None
            else f"memory_report {rep.label or ''!r} could not write its line to "
            f"{describe_target(self._file, self._log)}: {type(write_error).__name__}: "
            f"{write_error}"
        )
        if history_error is not None:
            msg = (
                f"memory_report could not write the allocator history to {self._history!r}: "
                f"{history_error}. Check that the directory exists and is writable."
            )
            if exc is None:
                error = RuntimeError(msg)
                if write_msg is not None:
                    error.add_note(f"cudakit.{write_msg}")
                raise error from history_error
            exc.add_note(f"cudakit.{msg}")
        if write_error is not None:
            if exc is None:  # the block went well: the failed write is the error
                write_error.add_note(f"cudakit.{write_msg}")
                raise write_error
            exc.add_note(f"cudakit.{write_msg}")  # the block's own error goes on unchanged

    def _write(self, line: str) -> None:
        write_line(line, self._file, self._log)

    def flush(self) -> None:
        """Write the pending aggregate line now (e.g. at the end of training)."""
        line = self._agg.flush()
        if line is not None:
            self._write(line)


@overload
def memory_report(label: Callable[P, R], /) -> MemoryReported[P, R]: ...


@overload
def memory_report(
    label: str | None = None,
    *,
    device: DeviceLike | Literal["all"] = None,
    file: IO[str] | None = ...,
    log: LogTarget | None = None,
    every: int | None = None,
    record_history: str | os.PathLike[str] | None = None,
    stacks: Literal["python", "all"] = "python",
) -> MemoryMeter: ...


def memory_report(
    label: Callable[P, R] | str | None = None,
    *,
    device: DeviceLike | Literal["all"] = None,
    file: IO[str] | Stderr | None = STDERR,
    log: LogTarget | None = None,
    every: int | None = None,
    record_history: str | os.PathLike[str] | None = None,
    stacks: Literal["python", "all"] = "python",
) -> MemoryMeter | MemoryReported[P, R]:
    """Measure the memory a block or a function uses: peaks, deltas, free memory, time.

    >>> import torch
    >>> from cudakit.memory import memory_report
    >>> with memory_report("alloc", device="cpu", file=None) as rep:
    ...     x = torch.ones(2**20)
    >>> rep.peak_allocated >= rep.allocated_before
    True
    >>> rep.raised is None and rep.to_dict()["label"]
    'alloc'
    >>> @memory_report(device="cpu", file=None)
    ... def step():
    ...     return torch.zeros(10).sum()
    >>> _ = step(); step.memory_report.last.label
    'step'

    On exit one concise line goes to stderr. Peak statistics are reset when the
    block starts, so the peak belongs to the block; nested reports keep their own
    peaks. An exception still produces a report (marked as raised) and then
    propagates unchanged; an out-of-memory error gets a note with the block's
    peak, reserved versus allocated and the largest free cached block. A line that
    cannot be written (a full disk, a file closed meanwhile) never hides the block's
    own exception: that goes on with a note saying so; after a block that went well,
    the write's error is raised, with the same note.

    As a decorator (``@memory_report`` or ``@memory_report(...)``) or a ``with``
    object reused in a loop, output is throttled: the first call is written
    at once, then one aggregate line (calls, max and mean peak, mean time) at most
    every 10 s; ``every=N`` writes one line per N calls instead. The latest report
    is ``fn.memory_report.last``; ``fn.memory_report.flush()`` writes what is pending.

    Args:
        label: a name for the block (decorators default to the function's name).
        device: ``None``/``"auto"`` follows :func:`~cudakit.device.resolve_device`
            (on Apple MPS it falls back to the CPU process); ``"cuda:N"``; ``"cpu"``
            for the process's resident memory (RSS); ``"all"`` for every visible
            CUDA device, whose properties are then sums over ``rep.devices``.
        file: where the line goes; defaults to ``sys.stderr`` (or nowhere when
            ``log`` is given); ``None`` silences it.
        log: a ``logging.Logger`` (lines at INFO) or a callable taking the line.
        every: write one line per ``every`` blocks/calls (aggregated), instead of
            the default time-based throttle.
        record_history: a path; records the CUDA allocator's history during the
            block and writes a snapshot there (open it at https://pytorch.org/memory_viz).
            CUDA only. Starts CUDA if needed, since you asked for it.
        stacks: the stacks ``record_history`` keeps for each allocation: ``"python"``
            (the default: quick to record and to dump) or ``"all"`` (C++ frames too; a
            dump can then take minutes).

    Returns:
        A ``MemoryMeter`` (``with`` yields a ``MemoryReport``), or the
        decorated function when used as bare ``@memory_report``.

    Raises:
        TypeError: an argument of the wrong type (a binary stream for ``file``).
        ValueError: ``every < 1``, ``record_history`` on a CPU device, a closed ``file``,
            or ``stacks`` other than ``"python"``/``"all"`` (or not ``"python"`` without
            ``record_history``).
        RuntimeError: entered inside a ``record_history`` report recording other ``stacks``.
        DeviceError: the device does not exist or cannot be measured.

    .. versionadded:: 0.1
    """
    if label is not None and not isinstance(label, str) and not callable(label):
        fail_type(
            "memory_report",
            "label",
            "a string naming the block",
            label,
            "For example: memory_report('train_step').",
        )
    file = check_file("memory_report", file)
    log = check_log("memory_report", log)
    if every is not None:
        every = check_int(
            "memory_report",
            "every",
            every,
            minimum=1,
            fix="It counts calls: every=1 writes a line for every call, e.g. every=100 for "
            "one in a hundred. Use file=None to silence the output instead.",
        )  # a NumPy int too
    check_optional(
        check_type,
        "memory_report",
        "record_history",
        record_history,
        types=(str, os.PathLike),
        expected="a file path for the allocator snapshot, or None",
        fix="For example: record_history='step.pickle'.",
    )
    check_choice(
        "memory_report",
        "stacks",
        stacks,
        ("python", "all"),
        fix="Pass stacks='python' (the default: fast to dump) or stacks='all' (C++ frames "
        "too: slow to dump).",
    )
    if stacks != "python" and record_history is None:
        raise ValueError(
            f"memory_report(stacks={stacks!r}) chooses the stacks of record_history=, which "
            "was not given; pass record_history='step.pickle' too, or drop stacks=."
        )
    if callable(label):  # bare @memory_report: every other argument checked above
        return MemoryMeter(None, device, file, log, every, record_history, stacks)(label)
    return MemoryMeter(label, device, file, log, every, record_history, stacks)


__getattr__ = renamed(__name__, {"MemoryReporter": MemoryMeter})
