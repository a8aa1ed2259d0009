"""Timing a call without waiting for the device: CUDA events, or the wall clock.

On CUDA a call is timed by two events recorded on the current stream, around the
call's work; the time between them is read only when the figures are (at the log
interval, or when you read an attribute), by which time the events have long
passed. Nothing waits at the call. On the CPU every op has finished when it returns,
so the wall clock (``time.perf_counter``) is exact. Other accelerators (MPS, XPU)
get the wall clock too: the time their calls take to queue, not to run.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["Clock", "EventClock", "WallClock", "clock_for"]


class Clock(Protocol):
    """Marks the start and end of a call; turns the pair into seconds later."""

    def start(self) -> Any:
        """A mark for the start of a call."""

    def stop(self, start: Any) -> Any:
        """The call's elapsed mark: seconds, or something that becomes seconds later."""

    def ready(self, mark: Any) -> bool:
        """Whether :meth:`seconds` of ``mark`` can be read without waiting."""

    def seconds(self, mark: Any) -> float:
        """The seconds ``mark`` stands for (may wait for the device)."""


class WallClock:
    """The host's clock: exact on the CPU, where every op has finished when it returns."""

    start = staticmethod(time.perf_counter)

    @staticmethod
    def stop(start: float) -> float:
        return time.perf_counter() - start

    @staticmethod
    def ready(mark: float) -> bool:
        return True

    @staticmethod
    def seconds(mark: float) -> float:
        return mark


class EventClock:
    """CUDA events around each call, read lazily; the events are reused once read.

    An event is recorded on the current stream. ``Event.record()`` would look that
    stream up through ``torch.cuda.current_stream()``, which builds a new ``Stream``
    object on every call (a few microseconds, twice per measured call); the clock asks
    torch for the current stream's identity instead (two plain calls) and builds the
    ``Stream`` again only when that changes (another device, a ``torch.cuda.stream``
    block).
    """

    def __init__(self) -> None:
        self._free: list[Any] = []
        self._known: tuple[Any, Any] = (None, None)  # (current stream's identity, Stream)

    def _current_stream(self) -> Any:
        get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
        get_device = getattr(torch._C, "_cuda_getDevice", None)
        if get_stream is None or get_device is None:  # not a torch this clock knows
            return torch.cuda.current_stream()
        key = get_stream(get_device())  # (stream id, device index, device type)
        known = self._known
        if key != known[0]:
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._known = known = (key, stream)  # one assignment: never a key with another's stream
        return known[1]

    def _event(self) -> Any:
        free = self._free
        event = free.pop() if free else torch.cuda.Event(enable_timing=True)
        event.record(self._current_stream())
        return event

    def start(self) -> Any:
        return self._event()

    def stop(self, start: Any) -> tuple[Any, Any]:
        return (start, self._event())

    def ready(self, mark: tuple[Any, Any]) -> bool:
        return bool(mark[1].query())  # a non-blocking query, not a wait

    def seconds(self, mark: tuple[Any, Any]) -> float:
        start, end = mark
        if not end.query():  # long passed when the figures are read: no wait then
            end.synchronize()
        seconds = float(start.elapsed_time(end)) / 1e3
        self._free += (start, end)
        return seconds


def clock_for(device: torch.device) -> WallClock | EventClock:
    """The clock for calls on ``device``: events on CUDA, the wall clock elsewhere."""
    return EventClock() if device.type == "cuda" else WallClock()
