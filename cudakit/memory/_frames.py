"""The open reports of this process, per device, so that nested reports keep their peaks.

``torch.cuda.reset_peak_memory_stats`` (and the CPU ``/proc/self/clear_refs`` reset)
are global per device. Every open report is a :class:`Frame` on its device's stack in
:data:`STACK`; before a later report resets the peak, each open frame keeps the
highest peak it saw, so an outer report's peak is the maximum of what it saw before an
inner reset, the inner peak and what follows. All of it is under ``STACK.lock``.
"""

from __future__ import annotations

import os
import threading

from . import _probes
from .results import DeviceMemory, MemorySnapshot

__all__ = ["STACK", "Frame", "FrameStack"]


class Frame:
    """One open report on one device: the highest peaks it saw before later resets."""

    __slots__ = (
        "alloc0",
        "device",
        "index",
        "peak_a",
        "peak_r",
        "res0",
        "shared",
        "since_start",
        "thread",
    )

    def __init__(self, device: str, index: int, thread: int) -> None:
        self.device = device
        self.index = index  # CUDA index, -1 for the CPU
        self.thread = thread
        self.peak_a = 0
        self.peak_r = 0
        self.alloc0 = 0
        self.res0 = 0
        self.since_start = False
        self.shared = False


def _absorb(frames: list[Frame], peak_a: int, peak_r: int) -> None:
    for f in frames:
        if peak_a > f.peak_a:
            f.peak_a = peak_a
        if peak_r > f.peak_r:
            f.peak_r = peak_r


class FrameStack:
    """Open frames per device and the depth of allocator-history recording.

    Methods other than :meth:`reset` expect the caller to hold :attr:`lock`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[str, list[Frame]] = {}
        self.history_depth = 0
        self.history_stacks: str | None = None  # what the running recording records

    def reset(self) -> None:
        """Forget every open report (a forked child has none); a fresh lock."""
        self.lock = threading.Lock()
        self.open.clear()
        self.history_depth = 0
        self.history_stacks = None

    def push(self, device: str, index: int) -> Frame:
        """Read the "before" numbers, keep open reports' peaks, reset the peak."""
        cuda, cpu = _probes.cuda, _probes.cpu
        me = threading.get_ident()
        frame = Frame(device, index, me)
        frames = self.open.setdefault(device, [])
        for f in frames:
            if f.thread != me:
                f.shared = frame.shared = True
        if index < 0:
            if frames:
                frame.alloc0, peak = cpu.rss_peak()
                _absorb(frames, peak, 0)
            else:
                frame.alloc0 = cpu.rss()
            frame.since_start = not cpu.reset_peak(frame.alloc0)
        elif cuda.is_initialized():  # else nothing is allocated: keep zeros, start nothing
            frame.alloc0, frame.res0, peak_a, peak_r = cuda.stats(index)
            _absorb(frames, peak_a, peak_r)
            cuda.reset_peak(index)
        frames.append(frame)
        return frame

    def discard(self, frames: list[Frame]) -> None:
        """Unregister frames without reading anything (a report that failed to open)."""
        for f in frames:
            self.open[f.device].remove(f)

    def pop(self, frame: Frame) -> DeviceMemory:
        """Read the "after" numbers and pass the peak on to reports still open."""
        cuda, cpu = _probes.cuda, _probes.cpu
        frames = self.open.setdefault(frame.device, [])
        if frame in frames:  # absent only in a child forked while the report was open
            frames.remove(frame)
        if frame.index < 0:
            rss, peak = cpu.rss_peak()
            _absorb(frames, peak, 0)
            free, total = cpu.free_total()
            return DeviceMemory(
                frame.device,
                frame.alloc0,
                rss,
                max(frame.peak_a, peak, rss, frame.alloc0),  # a peak never below either end
                free=free,
                total=total,
                peak_since_start=frame.since_start,
            )
        if not cuda.is_initialized():
            return DeviceMemory(frame.device, 0, 0, 0, 0, 0, 0, cuda_started=False)
        alloc, res, peak_a, peak_r = cuda.stats(frame.index)
        _absorb(frames, peak_a, peak_r)
        free, total = cuda.free_total(frame.index)
        return DeviceMemory(
            frame.device,
            frame.alloc0,
            alloc,
            max(frame.peak_a, peak_a, frame.alloc0, alloc),  # another thread may free meanwhile
            frame.res0,
            res,
            max(frame.peak_r, peak_r, frame.res0, res),
            free,
            total,
            cuda_started=True,
        )

    def now(self, device: str, index: int) -> MemorySnapshot:
        """The memory of a device now, peaks including what open reports saw; resets nothing."""
        cuda, cpu = _probes.cuda, _probes.cpu
        frames = self.open.get(device, [])
        seen_a = max((f.peak_a for f in frames), default=0)
        seen_r = max((f.peak_r for f in frames), default=0)
        if index < 0:
            rss, peak = cpu.rss_peak()
            free, total = cpu.free_total()
            return MemorySnapshot(device, rss, max(peak, seen_a, rss), free=free, total=total)
        if not cuda.is_initialized():
            return MemorySnapshot(device, 0, 0, 0, 0, cuda_started=False)
        alloc, res, peak_a, peak_r = cuda.stats(index)
        free, total = cuda.free_total(index)
        return MemorySnapshot(
            device,
            alloc,
            max(peak_a, seen_a),
            res,
            max(peak_r, seen_r),
            free,
            total,
            cuda_started=True,
        )

    def begin_history(self, stacks: str) -> None:
        """Start the allocator history for the first open ``record_history`` report."""
        if self.history_depth == 0:
            _probes.cuda.start_history(stacks)
            self.history_stacks = stacks
        self.history_depth += 1

    def end_history(self) -> None:
        """Stop the allocator history when the last ``record_history`` report closes."""
        self.history_depth = max(0, self.history_depth - 1)
        if self.history_depth == 0:
            self.history_stacks = None
            _probes.cuda.stop_history()


#: The open reports of this process.
STACK = FrameStack()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=STACK.reset)
