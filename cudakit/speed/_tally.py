"""The meter's bookkeeping: calls grouped into optimizer steps, totals and a rolling window.

A call is queued: one tuple appended, and the call and step counters moved on (the
hot path, run once per call in the middle of a training loop, where every extra line
runs with cold caches). Queued calls are added to their steps in a batch, every
:data:`BATCH` calls or when anything reads the figures: each adds its figures to its
step (a small list: calls, seconds, samples, tokens, FLOPs). What is known on the
host (a wall-clock time, a count given as a number) is added then; what lives on the
device (a CUDA event pair, a count given as a tensor) is kept aside, unread, until
:meth:`Tally.resolve`, which the meter calls at its log interval or when a figure is
read: then every kept value is read in one go and added to its step (and to the
totals, once the step is closed). When a step closes it joins the rolling window
(the last ``window`` steps) and the totals.

Kept values are bounded: once more than a few windows' worth wait, those of steps
that have left the rolling window are folded into the totals (event times once the
events have passed, tensor counts summed on the device), so a loop that never reads
the figures holds only a few hundred of them, and nothing is read to fold them.

Like the ``autocast_step`` it measures, a tally belongs to one training loop: adding a
call takes no lock (it is the hot path), so one meter is not shared between threads.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import reduce
from operator import add, itemgetter
from typing import Any

import torch

from ._clock import Clock
from .counts import Count

__all__ = ["BATCH", "Sums", "Tally"]

#: Queued calls are added to their steps in batches of this many (or when read).
BATCH = 64

_FIELDS = ("seconds", "samples", "tokens", "flops")  # a step's fields 1 to 4
# A step: [calls, seconds, samples, tokens, flops, closed, serial number].
_CLOSED, _SERIAL = 5, 6
# What Sums.of adds up: a step's fields 0 to 4, each from its start value.
_SUMMED = tuple((itemgetter(i), 0 if i == 0 else 0.0) for i in range(5))


@dataclass
class Sums:
    """Summed figures of some steps (``flops`` is the raw per-call count, see CallCounter)."""

    steps: int = 0
    calls: int = 0
    seconds: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    flops: float = 0.0

    @classmethod
    def of(cls, steps: Iterable[list[Any]]) -> Sums:
        """The sums of closed steps: each field added up in order, as a loop would.

        ``reduce(add, ...)`` runs the loop in C (the log line sums a window of a hundred
        steps), in the order and with the roundings of ``+=`` (``sum()`` of floats
        compensates its roundings from Python 3.12 on).
        """
        rows = steps if isinstance(steps, (list, tuple, deque)) else list(steps)
        calls, seconds, samples, tokens, flops = (
            reduce(add, map(get, rows), start) for get, start in _SUMMED
        )
        return cls(len(rows), int(calls), seconds, samples, tokens, flops)


def _new_step() -> list[Any]:
    return [0, 0.0, 0.0, 0.0, 0.0, False, 0]


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """The values of one-element tensors, one host read per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = [0.0] * len(tensors)
    for indices in groups.values():
        values = torch.stack([tensors[i].reshape(()) for i in indices]).tolist()
        for i, v in zip(indices, values, strict=True):
            out[i] = float(v)
    return out


def _device_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One summed tensor per device and dtype: folded tensor counts, never read here."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.reshape(()))
    return [torch.stack(group).sum() for group in groups.values()]


class Tally:
    """Calls, steps, their summed figures and the rolling window of the last steps."""

    def __init__(self, clock: Clock, window: int, start: int = 0) -> None:
        self.clock = clock
        self.window = window
        #: Calls and closed steps counted on the host (no read needed), queued ones too;
        #: ``steps`` counts on from ``start``, the steps done before the first call (a
        #: resumed run's), so that the hot path tests the log interval on it as it is.
        self.calls = 0
        self.start = start
        self.steps = start
        #: Calls of the step that is open now.
        self.open_calls = 0
        # Calls not added to their steps yet, in order: (mark, samples, tokens, flops,
        # ends), or None where end_window() closed the open step.
        self._queue: list[tuple[Any, Count, Count, Count, bool] | None] = []
        self._open = _new_step()
        self._closed = 0  # steps closed by the calls added so far
        self._recent: deque[list[Any]] = deque(maxlen=window)
        self._total = _new_step()
        # (step, field, event pair or tensor): values not read yet, oldest first.
        self._kept: list[tuple[list[Any], int, Any]] = []
        self._fold_at = 4 * window + 64
        # Tensor counts of folded steps per field (samples, tokens, flops), summed on
        # the device, not read yet.
        self._deferred: list[list[torch.Tensor]] = [[], [], [], []]

    def add(self, mark: Any, samples: Count, tokens: Count, flops: Count, ends: bool) -> bool:
        """Count one call; True when it closed a step (the hot path: no read, no op)."""
        queue = self._queue
        queue.append((mark, samples, tokens, flops, ends))
        self.calls += 1
        if ends:
            self.steps += 1
            self.open_calls = 0
        else:
            self.open_calls += 1
        if len(queue) >= BATCH:
            self._drain()
        return ends

    def end_window(self) -> None:
        """Close the open step (it was stepped outside the meter, e.g. by ``flush()``)."""
        if self.open_calls:
            self._queue.append(None)
            self.steps += 1
            self.open_calls = 0

    def _drain(self) -> None:
        """Add the queued calls to their steps, in order; close the steps they end.

        One loop with its state in locals (it runs once per call, in batches): a call
        whose figures are all numbers adds them at once; a device mark or a tensor
        count is kept aside for :meth:`resolve`. A closed step joins the rolling window
        and the totals.
        """
        queue, self._queue = self._queue, []
        kept, total, join = self._kept, self._total, self._recent.append
        step, closed = self._open, self._closed
        for record in queue:
            if record is not None:  # (None: end_window() closed the open step here)
                mark, samples, tokens, flops, ends = record
                step[0] += 1
                if type(mark) is float:
                    step[1] += mark
                else:
                    kept.append((step, 1, mark))
                if type(samples) is int or type(samples) is float:
                    step[2] += samples
                else:
                    kept.append((step, 2, samples))
                if type(tokens) is int or type(tokens) is float:
                    step[3] += tokens
                else:
                    kept.append((step, 3, tokens))
                if type(flops) is int or type(flops) is float:
                    step[4] += flops
                else:
                    kept.append((step, 4, flops))
                if not ends:
                    continue
            closed += 1
            step[_CLOSED] = True
            step[_SERIAL] = closed
            join(step)
            total[0] += step[0]
            total[1] += step[1]
            total[2] += step[2]
            total[3] += step[3]
            total[4] += step[4]
            step = [0, 0.0, 0.0, 0.0, 0.0, False, 0]
        self._open, self._closed = step, closed
        if len(kept) > self._fold_at:
            self._fold()

    def _fold(self) -> None:
        """Fold kept values of steps that left the rolling window, without a read."""
        kept, ready = self._kept, self.clock.ready
        gone = self._closed - self.window  # steps up to this serial number have left
        cut = 0
        for step, field, value in kept:
            if step[_SERIAL] == 0 or step[_SERIAL] > gone:
                break
            if field == 1 and not ready(value):
                break  # the device is behind: fold later
            cut += 1
        tensors: list[list[torch.Tensor]] = [[], [], [], []]
        seconds_of, total = self.clock.seconds, self._total
        for _, field, value in kept[:cut]:
            if field == 1:
                total[1] += seconds_of(value)
            else:
                tensors[field - 1].append(value)
        for i, items in enumerate(tensors):
            if items:
                self._deferred[i] = _device_sums(self._deferred[i] + items)
        del kept[:cut]

    def resolve(self) -> None:
        """Read every kept value (times, tensor counts) into its step and the totals.

        Raises:
            ValueError: a tensor count was negative or NaN; nothing changes then.
        """
        self._drain()
        kept, deferred = self._kept, self._deferred
        named = [(field, v) for _, field, v in kept if field != 1]
        named += [(i + 1, t) for i, ts in enumerate(deferred) for t in ts]
        numbers = _read([t for _, t in named])
        for (field, _), number in zip(named, numbers, strict=True):
            if not 0 <= number < math.inf:
                raise ValueError(
                    f"speed_report({_FIELDS[field - 1]}=...) gave {number!r} for a call; it "
                    "expects a finite number >= 0 (tensor counts are checked when they are "
                    "read)."
                )
        self._kept, self._deferred = [], [[], [], [], []]
        values = iter(numbers)
        seconds_of, total = self.clock.seconds, self._total
        for step, field, value in kept:
            number = seconds_of(value) if field == 1 else next(values)
            step[field] += number
            if step[_CLOSED]:
                total[field] += number
        for i, ts in enumerate(deferred):
            for _ in ts:
                total[i + 1] += next(values)

    def recent(self) -> Sums:
        """The rolling window (read: call :meth:`resolve` first)."""
        self._drain()
        return Sums.of(self._recent)

    def total(self) -> Sums:
        """Every closed step (read: call :meth:`resolve` first)."""
        self._drain()
        t = self._total
        return Sums(self.steps - self.start, t[0], t[1], t[2], t[3], t[4])

    def move_to(self, step: int) -> None:
        """Count on from ``step`` (a resumed run's position): the figures are unchanged."""
        delta = step - self.steps
        self.start += delta
        self.steps += delta
