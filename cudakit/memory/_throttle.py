"""The output throttle of a reused reporter: one aggregate line per window of calls."""

from __future__ import annotations

import threading
from typing import Final

from .._units import format_bytes, format_seconds, format_signed_bytes
from . import _probes
from .results import MemoryReport

__all__ = ["AUTO_INTERVAL_S", "Throttle"]

#: Seconds between two aggregate lines when ``every`` is not given.
AUTO_INTERVAL_S: Final = 10.0


class Throttle:
    """Throttled output shared by a reporter and the clones a decorator makes."""

    def __init__(self, every: int | None) -> None:
        self.every = every
        self.lock = threading.Lock()
        self.calls = 0
        self.last: MemoryReport | None = None
        self.n = 0
        self.first: MemoryReport | None = None
        self.since: float | None = None  # the output window starts at the first add()

    def _reset(self, now: float) -> None:
        self.n = 0
        self.first = None
        self.peak_max = 0
        self.peak_sum = 0
        self.delta_sum = 0
        self.time_sum = 0.0
        self.time_max = 0.0
        self.shared = False
        self.since = now

    def count(self, rep: MemoryReport) -> None:
        """Count ``rep`` without writing anything (a silent reporter)."""
        with self.lock:
            self.calls += 1
            self.last = rep

    def add(self, rep: MemoryReport) -> str | None:
        """Count ``rep``; return the line to write now, if any."""
        with self.lock:
            self.calls += 1
            self.last = rep
            now = _probes.monotonic()
            since = self.since
            if since is None:  # the first report opens the first window
                self._reset(now)
                since = now
            if rep.raised is not None:
                return rep.line()  # failures are rare and always worth a line
            if self.n == 0:
                self.first = rep
            self.n += 1
            self.peak_max = max(self.peak_max, rep.peak_allocated)
            self.peak_sum += rep.peak_allocated
            self.delta_sum += rep.allocated_delta
            self.time_sum += rep.elapsed
            self.time_max = max(self.time_max, rep.elapsed)
            self.shared |= rep.shared
            due = (
                self.n >= self.every
                if self.every is not None
                else self.calls == 1 or now - since >= AUTO_INTERVAL_S
            )
            return self._emit(now) if due else None

    def _emit(self, now: float) -> str | None:
        first = self.first
        if first is None:
            return None
        if self.n == 1:
            line = first.line()
        else:
            head = "memory_report" + (f" {first.label!r}" if first.label else "")
            line = (
                f"{head} {first.device} x{self.n} calls: peak max "
                f"{format_bytes(self.peak_max)}, mean {format_bytes(self.peak_sum // self.n)}; "
                f"allocated Δ mean {format_signed_bytes(self.delta_sum // self.n)}; time mean "
                f"{format_seconds(self.time_sum / self.n)}, max {format_seconds(self.time_max)}"
            )
            if self.shared:
                line += " [shared: another thread used this device meanwhile]"
        self._reset(now)
        return line

    def flush(self) -> str | None:
        """The pending aggregate line, if any; starts a new window."""
        with self.lock:
            return self._emit(_probes.monotonic())
