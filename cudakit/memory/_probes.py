"""What ``memory_report`` reads: the CUDA caching allocator and the process's ``/proc``.

Everything read from ``torch.cuda`` goes through :data:`cuda` and everything read from
``/proc`` through :data:`cpu`; tests replace those two objects (and :data:`monotonic`,
the clock of the output throttle) with fakes whose numbers they control. Other
modules read them as ``_probes.cuda`` at call time, so a replacement takes effect.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .._accel import current_cuda_index

__all__ = ["ProcCpu", "TorchCuda", "cpu", "cuda", "monotonic"]


class TorchCuda:
    """The few ``torch.cuda`` reads this module makes; tests substitute a fake."""

    def is_available(self) -> bool:
        return bool(torch.cuda.is_available())

    def is_initialized(self) -> bool:
        return bool(torch.cuda.is_initialized())

    def device_count(self) -> int:
        return int(torch.cuda.device_count())

    def current_index(self) -> int:
        """This thread's current CUDA device, without starting CUDA (0 before it starts)."""
        return current_cuda_index()

    def stats(self, index: int) -> tuple[int, int, int, int]:
        """(allocated, reserved, peak allocated, peak reserved) since the last reset."""
        s = torch.cuda.memory_stats_as_nested_dict(index)
        if not s:
            return 0, 0, 0, 0
        a, r = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
        return int(a["current"]), int(r["current"]), int(a["peak"]), int(r["peak"])

    def reset_peak(self, index: int) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def free_total(self, index: int) -> tuple[int | None, int | None]:
        """Free and total device memory, without creating a context on ``index``."""
        # mem_get_info switches to ``index``, which creates a context there (CUDA 12).
        has_ctx = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        if has_ctx(index) if has_ctx is not None else index == torch.cuda.current_device():
            free, total = torch.cuda.mem_get_info(index)
            return int(free), int(total)
        return None, int(torch.cuda.get_device_properties(index).total_memory)

    def largest_free_block(self, index: int) -> int | None:
        """Largest free block inside the allocator's cached segments (after an OOM)."""
        best = None
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") != index:
                continue
            for block in seg.get("blocks", ()):
                if block.get("state") == "inactive":
                    size = int(block.get("size", 0))
                    best = size if best is None else max(best, size)
        return best

    def start_history(self, stacks: str) -> None:
        """Record the allocator's history with ``stacks`` ("python", or "all": C++ too)."""
        # The allocator records only for devices it has set up: start CUDA first (asked for).
        torch.cuda.init()
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks=stacks, max_entries=100_000
        )

    def dump_history(self, path: str) -> None:
        torch.cuda.memory._dump_snapshot(path)

    def stop_history(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


class ProcCpu:
    """Resident memory of this process, read cheaply from ``/proc`` (Linux)."""

    forks = 0  # incremented in every forked child

    def __init__(self) -> None:
        self._forks = -1
        self._status = -1
        self._statm = -1
        self._clear = -1
        self._meminfo = -1
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.resettable = True
        self._ru_exact = False  # getrusage's peak equals VmHWM since the last reset
        self._floor = 1 << 62
        self._mem: tuple[int | None, int | None] = (None, None)
        self._mem_at = -1.0

    def _open(self) -> None:
        # Cached descriptors; reopened after fork (``/proc/self`` is resolved at open time).
        # A fork bumps ``forks`` (see _after_fork), which is cheaper than os.getpid() per read.
        if self._forks == ProcCpu.forks:
            return
        self._forks = ProcCpu.forks
        for fd in (self._status, self._statm, self._clear, self._meminfo):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._status = self._statm = self._clear = self._meminfo = -1
        self.resettable = True
        self._ru_exact = False
        self._floor = 1 << 62  # read VmHWM until the next reset measures the floor
        self._mem_at = -1.0
        try:
            self._status = os.open("/proc/self/status", os.O_RDONLY)
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._status = self._statm = -1
        try:
            self._clear = os.open("/proc/self/clear_refs", os.O_WRONLY)
        except OSError:
            self.resettable = False
        try:
            self._meminfo = os.open("/proc/meminfo", os.O_RDONLY)
        except OSError:
            self._meminfo = -1

    @staticmethod
    def _field(text: bytes, key: bytes) -> int:
        i = text.find(key)
        if i < 0:
            return 0
        return int(text[i + len(key) : text.index(b"k", i)]) * 1024

    @staticmethod
    def _maxrss() -> int:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024

    def rss(self) -> int:
        """Resident set size now (``/proc/self/statm``: the cheapest read)."""
        self._open()
        return self._rss()

    def _rss(self) -> int:
        if self._statm < 0:
            return self._maxrss()
        return int(os.pread(self._statm, 128, 0).split()[1]) * self.page

    def peak(self) -> int:
        """Peak RSS since the last :meth:`reset_peak` (or process start).

        ``getrusage`` is 5x cheaper than ``/proc/self/status`` and reads the same
        kernel high-water mark, except that it also includes a value the kernel
        saves when a thread exits, which ``clear_refs`` does not reset. That value
        is measured right after each reset (``_floor``); while it could hide the
        true peak, the exact ``VmHWM`` line of ``/proc/self/status`` is read instead.
        """
        ru = self._maxrss()
        if self._ru_exact or ru > self._floor or self._status < 0:
            return ru
        return self._field(os.pread(self._status, 8192, 0), b"VmHWM:")

    def rss_peak(self) -> tuple[int, int]:
        """(RSS, peak RSS since the last reset or process start)."""
        self._open()
        return self._rss(), self.peak()

    def reset_peak(self, rss_before: int) -> bool:
        """Reset the peak RSS to the current RSS; False where the kernel refuses."""
        self._open()
        if not self.resettable or self._status < 0:
            self._ru_exact = False
            return False
        try:
            os.write(self._clear, b"5")
        except OSError:
            self.resettable = False
            self._ru_exact = False
            return False
        self._floor = self._maxrss()
        self._ru_exact = self._floor <= rss_before
        return True

    def free_total(self) -> tuple[int | None, int | None]:
        """Available and total system memory; ``MemAvailable`` is sampled at most every 50 ms."""
        self._open()
        if self._meminfo < 0:
            return None, None
        now = time.monotonic()
        if now - self._mem_at > 0.05:
            text = os.pread(self._meminfo, 4096, 0)
            self._mem = self._field(text, b"MemAvailable:"), self._field(text, b"MemTotal:")
            self._mem_at = now
        return self._mem


def _after_fork() -> None:
    ProcCpu.forks += 1  # reopen /proc/self descriptors: they still name the parent


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

#: The CUDA probe (a :class:`TorchCuda`, or a test's fake).
cuda: Any = TorchCuda()
#: The CPU probe (a :class:`ProcCpu`, or a test's fake).
cpu: Any = ProcCpu()
#: The clock of the output throttle.
monotonic: Callable[[], float] = time.monotonic
