"""The meter's bookkeeping: calls grouped into optimizer steps, totals and a rolling window.

A call adds one record ``(time mark, samples, tokens, flops)`` and, when it closes an
accumulation window, an end marker. Nothing is read from the device then: the time
marks and any tensor counts stay as they are until :meth:`Tally.resolve`, which the
meter calls at its log interval or when a figure is read. Unread records are bounded:
when more than ``2 * window`` closed steps wait, the oldest are folded into the totals
(their times once their events have passed, tensor counts summed on the device), so
a loop that never reads the figures still holds only a few hundred records.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .clock import Clock
from .counts import Count

__all__ = ["Sums", "Tally"]

_END = None  # the end marker of an accumulation window in the pending records
_FIELDS = ("samples", "tokens", "flops")


@dataclass
class Sums:
    """Summed figures of some steps (``flops`` is the raw per-call count, see CallCounter)."""

    steps: int = 0
    calls: int = 0
    seconds: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    flops: float = 0.0

    def add(self, other: Sums) -> None:
        self.steps += other.steps
        self.calls += other.calls
        self.seconds += other.seconds
        self.samples += other.samples
        self.tokens += other.tokens
        self.flops += other.flops

    @classmethod
    def of(cls, items: Iterable[Sums]) -> Sums:
        out = cls()
        for item in items:
            out.add(item)
        return out


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


class Tally:
    """Calls, steps, their summed figures and the rolling window of the last steps."""

    def __init__(self, clock: Clock, window: int) -> None:
        self.lock = threading.Lock()
        self.clock = clock
        self.window = window
        #: Calls and closed steps counted on the host (no read needed).
        self.calls = 0
        self.steps = 0
        #: Calls of the window that is open now.
        self.open_calls = 0
        self._pending: list[tuple[Any, Count, Count, Count] | None] = []
        self._pending_steps = 0
        self._open = Sums()  # resolved calls of the open window
        self._recent: deque[Sums] = deque(maxlen=window)
        self._total = Sums()
        # Tensor counts of folded steps, summed on the device, not read yet.
        self._deferred: dict[str, list[torch.Tensor]] = {f: [] for f in _FIELDS}

    def add(self, mark: Any, samples: Count, tokens: Count, flops: Count, ends: bool) -> bool:
        """Count one call; True when it closed a window."""
        with self.lock:
            self._pending.append((mark, samples, tokens, flops))
            self.calls += 1
            if not ends:
                self.open_calls += 1
                return False
            self._close()
            return True

    def end_window(self) -> None:
        """Close the open window (it was stepped outside the meter, e.g. by ``flush()``)."""
        with self.lock:
            if self.open_calls:
                self._close()

    def _close(self) -> None:
        self._pending.append(_END)
        self.steps += 1
        self.open_calls = 0
        self._pending_steps += 1
        if self._pending_steps > 2 * self.window:
            self._fold(self._pending_steps - self.window)

    def _fold(self, steps: int) -> None:
        """Fold the oldest ``steps`` closed steps into the totals without a host read."""
        pending, cut, seen = self._pending, 0, 0
        while seen < steps:
            if pending[cut] is _END:
                seen += 1
            cut += 1
        last = next(r for r in reversed(pending[:cut]) if r is not _END)
        if not self.clock.ready(last[0]):  # the device is far behind: fold later
            return
        tensors: dict[str, list[torch.Tensor]] = {f: [] for f in _FIELDS}
        sums = self._open
        for record in pending[:cut]:
            if record is _END:
                sums.steps = 1
                self._total.add(sums)
                sums = Sums()
                continue
            mark, *counts = record
            sums.calls += 1
            sums.seconds += self.clock.seconds(mark)
            for name, value in zip(_FIELDS, counts, strict=True):
                if isinstance(value, torch.Tensor):
                    tensors[name].append(value)
                else:
                    setattr(sums, name, getattr(sums, name) + value)
        self._open = sums
        for name, items in tensors.items():
            self._deferred[name] = _device_sums(self._deferred[name] + items)
        del pending[:cut]
        self._pending_steps -= steps

    def resolve(self) -> None:
        """Read every pending record: times, tensor counts; group them into steps.

        Raises:
            ValueError: a tensor count was negative or NaN; nothing changes then.
        """
        with self.lock:
            pending, deferred = self._pending, self._deferred
            named = [
                (name, v)
                for r in pending
                if r is not _END
                for name, v in zip(_FIELDS, r[1:], strict=True)
                if isinstance(v, torch.Tensor)
            ]
            named += [(f, t) for f in _FIELDS for t in deferred[f]]
            numbers = _read([t for _, t in named])
            for (name, _), number in zip(named, numbers, strict=True):
                if not number >= 0:
                    raise ValueError(
                        f"speed_report({name}=...) gave {number!r} for a call; it expects a "
                        "number >= 0 (tensor counts are checked when they are read)."
                    )
            self._pending, self._pending_steps = [], 0
            self._deferred = {f: [] for f in _FIELDS}
            values = iter(numbers)
            sums = self._open
            for record in pending:
                if record is _END:
                    sums.steps = 1
                    self._recent.append(sums)
                    self._total.add(sums)
                    sums = Sums()
                    continue
                mark, *counts = record
                sums.calls += 1
                sums.seconds += self.clock.seconds(mark)
                for name, value in zip(_FIELDS, counts, strict=True):
                    number = next(values) if isinstance(value, torch.Tensor) else value
                    setattr(sums, name, getattr(sums, name) + number)
            self._open = sums
            for name in _FIELDS:
                for _ in deferred[name]:
                    setattr(self._total, name, getattr(self._total, name) + next(values))

    def recent(self) -> Sums:
        """The resolved rolling window (call :meth:`resolve` first)."""
        with self.lock:
            return Sums.of(self._recent)

    def total(self) -> Sums:
        """Every resolved step (call :meth:`resolve` first)."""
        with self.lock:
            return Sums.of((self._total,))


def _device_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One summed tensor per device and dtype: the fold's tensor counts, never read here."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.reshape(()))
    return [torch.stack(group).sum() for group in groups.values()]
