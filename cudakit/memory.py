"""Memory statistics around any block: :func:`memory_report` and :func:`memory_snapshot`.

:func:`memory_report` measures a block (``with``) or every call of a function
(``@``): allocated and reserved memory before and after, the peaks *inside* the
block, free and total device memory, and the wall time. On CUDA it reads the
caching allocator; on the CPU it reads the process's resident set size (RSS), so
the same code runs on a laptop. :func:`memory_snapshot` gives the numbers now.

Design notes:

* **Never starts CUDA.** Before CUDA is initialised nothing can be allocated on a
  GPU, so a report says "CUDA not started" instead of creating a context.
* **Nesting is safe.** ``torch.cuda.reset_peak_memory_stats`` (and the CPU
  ``/proc/self/clear_refs`` reset) are global per device, so every open report
  keeps the peak it saw before each later reset: an outer report's peak is the
  maximum of what it saw before an inner reset, the inner peak and what follows.
* **Threads.** All bookkeeping is under one lock. Allocator counters are global
  per device, so when reports on different threads overlap on the same device
  their numbers include each other's allocations; such reports are marked
  ``shared=True`` and say so in their text rather than being silently wrong.
* **Seams.** Everything read from ``torch.cuda`` goes through the ``_cuda``
  object and everything read from ``/proc`` through ``_cpu``; tests replace them
  with fakes whose numbers they control.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any, Final, Literal, Protocol, TypeVar, overload

import torch
from typing_extensions import ParamSpec, Self

from ._accel import current_cuda_index
from ._contextlib import ContextDecorator
from ._oom import is_oom_error
from ._units import format_bytes
from .device import DeviceLike, resolve_device
from .exceptions import DeviceError

__all__ = [
    "DeviceMemory",
    "MemoryReport",
    "MemoryReported",
    "MemoryReporter",
    "MemorySnapshot",
    "memory_report",
    "memory_snapshot",
]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

#: Seconds between two aggregate lines when ``every`` is not given.
AUTO_INTERVAL_S: Final = 10.0
_MEMORY_VIZ: Final = "https://pytorch.org/memory_viz"


class _Stderr:
    """Sentinel default for ``file=``: whatever ``sys.stderr`` is when a line is written."""

    def __repr__(self) -> str:
        return "sys.stderr"


_STDERR: Final = _Stderr()

LogTarget = logging.Logger | Callable[[str], object]


# --------------------------------------------------------------------------- seams


class _TorchCuda:
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

    def start_history(self) -> None:
        # The allocator records only for devices it has set up: start CUDA first (asked for).
        torch.cuda.init()
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=100_000)

    def dump_history(self, path: str) -> None:
        torch.cuda.memory._dump_snapshot(path)

    def stop_history(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


class _ProcCpu:
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
        if self._forks == _ProcCpu.forks:
            return
        self._forks = _ProcCpu.forks
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


_cuda: Any = _TorchCuda()
_cpu: Any = _ProcCpu()
_monotonic: Callable[[], float] = time.monotonic


# --------------------------------------------------------------------------- results


def _signed(n: int | None) -> str:
    if n is None:
        return "n/a"
    return ("+" if n >= 0 else "") + format_bytes(n)


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device's memory did during one block (exact bytes).

    On CUDA, *allocated* is memory held by tensors and *reserved* is what the
    caching allocator holds from the driver. On the CPU, *allocated* is the
    process's resident set size (RSS) and the reserved fields are ``None``.

    >>> from cudakit.memory import DeviceMemory
    >>> d = DeviceMemory("cpu", allocated_before=10, allocated_after=4, peak_allocated=30)
    >>> d.allocated_delta, d.peak_increase, d.reserved_delta
    (-6, 20, None)

    .. versionadded:: 0.1
    """

    device: str
    allocated_before: int
    allocated_after: int
    peak_allocated: int
    reserved_before: int | None = None
    reserved_after: int | None = None
    peak_reserved: int | None = None
    free: int | None = None
    total: int | None = None
    cuda_started: bool | None = None
    peak_since_start: bool = False

    @property
    def allocated_delta(self) -> int:
        """``allocated_after - allocated_before``."""
        return self.allocated_after - self.allocated_before

    @property
    def reserved_delta(self) -> int | None:
        """``reserved_after - reserved_before`` (``None`` on the CPU)."""
        if self.reserved_before is None or self.reserved_after is None:
            return None
        return self.reserved_after - self.reserved_before

    @property
    def peak_increase(self) -> int:
        """How far the peak rose above what was allocated when the block started."""
        return self.peak_allocated - self.allocated_before

    def line(self) -> str:
        """One concise line for this device."""
        if self.cuda_started is False:
            return f"{self.device}: CUDA not started in this process, nothing allocated"
        cpu = self.reserved_before is None
        what = "RSS" if cpu else "allocated"
        parts = [
            f"{self.device}: peak {format_bytes(self.peak_allocated)} "
            f"({_signed(self.peak_increase)})",
            f"{what} {format_bytes(self.allocated_before)} → "
            f"{format_bytes(self.allocated_after)} ({_signed(self.allocated_delta)})",
        ]
        if not cpu:
            parts.append(
                f"reserved {format_bytes(self.reserved_before)} → "
                f"{format_bytes(self.reserved_after)} ({_signed(self.reserved_delta)}, "
                f"peak {format_bytes(self.peak_reserved)})"
            )
        if self.total is not None:
            parts.append(
                f"{'available' if cpu else 'free'} {format_bytes(self.free)} of "
                f"{format_bytes(self.total)}"
            )
        if self.peak_since_start:
            parts.append("peak RSS since process start (cannot reset it here)")
        return ", ".join(parts)


def _sum(values: list[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


@dataclasses.dataclass(eq=True)
class MemoryReport:
    """The memory a block used; yielded by ``with memory_report() as rep``.

    Its numbers are filled in when the block exits; reading them earlier raises
    ``RuntimeError``. With one device the properties are that device's numbers;
    with ``device="all"`` they are sums over :attr:`devices`.

    >>> from cudakit.memory import MemoryReport, memory_report
    >>> with memory_report("step", device="cpu", file=None) as rep:
    ...     pass
    >>> rep.device, rep.raised, rep.peak_allocated >= rep.allocated_before
    ('cpu', None, True)
    >>> MemoryReport.from_json(rep.to_json()) == rep
    True

    .. versionadded:: 0.1
    """

    label: str | None
    devices: tuple[DeviceMemory, ...] = ()
    elapsed: float = 0.0
    raised: str | None = None
    shared: bool = False
    history: str | None = None
    done: bool = dataclasses.field(default=False, repr=False, compare=False)
    failed: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def _devs(self) -> tuple[DeviceMemory, ...]:
        if self.failed is not None:
            raise RuntimeError(
                f"memory report {self.label or ''!r} has no numbers: reading the memory "
                f"counters when the block ended failed with {self.failed}. The block's own "
                "error, if any, carries a note saying so; fix that error first."
            )
        if not self.done:
            raise RuntimeError(
                f"memory report {self.label or ''!r} is still open: its numbers exist once the "
                "`with` block exits. Read them after the block, e.g. "
                "`with memory_report() as rep: ...` then `rep.peak_allocated`; "
                "use memory_snapshot() for the numbers now."
            )
        return self.devices

    def _total(self, name: str) -> Any:
        devs = self._devs()
        if len(devs) == 1:
            return getattr(devs[0], name)
        return _sum([getattr(d, name) for d in devs])

    @property
    def device(self) -> str:
        """The device measured (``"cuda:0"``, ``"cpu"``) or a comma-joined list."""
        return ", ".join(d.device for d in self._devs())

    @property
    def peak_allocated(self) -> int:
        """Peak allocated bytes inside the block (CPU: peak RSS)."""
        return int(self._total("peak_allocated"))

    @property
    def peak_reserved(self) -> int | None:
        """Peak reserved bytes inside the block (``None`` on the CPU)."""
        return self._total("peak_reserved")  # type: ignore[no-any-return]

    @property
    def allocated_before(self) -> int:
        """Allocated bytes when the block started (CPU: RSS)."""
        return int(self._total("allocated_before"))

    @property
    def allocated_after(self) -> int:
        """Allocated bytes when the block ended (CPU: RSS)."""
        return int(self._total("allocated_after"))

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes the block left behind (negative if it freed memory)."""
        return int(self._total("allocated_delta"))

    @property
    def reserved_before(self) -> int | None:
        """Reserved bytes when the block started (``None`` on the CPU)."""
        return self._total("reserved_before")  # type: ignore[no-any-return]

    @property
    def reserved_after(self) -> int | None:
        """Reserved bytes when the block ended (``None`` on the CPU)."""
        return self._total("reserved_after")  # type: ignore[no-any-return]

    @property
    def reserved_delta(self) -> int | None:
        """Reserved bytes the block added to the allocator's cache."""
        return self._total("reserved_delta")  # type: ignore[no-any-return]

    @property
    def peak_increase(self) -> int:
        """Peak allocated minus allocated at the start: what the block needed on top."""
        return int(self._total("peak_increase"))

    @property
    def free(self) -> int | None:
        """Free device memory at the end (CPU: available system memory)."""
        return self._total("free")  # type: ignore[no-any-return]

    @property
    def total(self) -> int | None:
        """Total device memory (CPU: total system memory)."""
        return self._total("total")  # type: ignore[no-any-return]

    def line(self) -> str:
        """The concise one-line summary printed on exit."""
        devs = self._devs()
        head = "memory_report" + (f" {self.label!r}" if self.label else "")
        body = " | ".join(d.line() for d in devs)
        tail = f", {_fmt_time(self.elapsed)}"
        if self.raised:
            tail += f" [raised {self.raised}]"
        if self.shared:
            tail += " [shared: another thread used this device meanwhile]"
        if self.history:
            tail += f" [history: {self.history}]"
        return f"{head} {body}{tail}"

    def __str__(self) -> str:
        if self.failed is not None:
            return f"memory_report {self.label or ''!r} (no numbers: {self.failed})"
        if not self.done:
            return f"memory_report {self.label or ''!r} (still open)"
        rows = [
            f"memory_report {self.label!r}" if self.label else "memory_report",
            f"  time {_fmt_time(self.elapsed)}"
            + (f", raised {self.raised}" if self.raised else "")
            + (
                ", SHARED with another thread (numbers include its allocations)"
                if self.shared
                else ""
            ),
        ]
        cols = f"  {'':<22}{'before':>13}{'after':>13}{'delta':>13}{'peak':>13}"
        for d in self.devices:
            rows.append(f"  {d.device}")
            if d.cuda_started is False:
                rows.append("    CUDA not started in this process: nothing allocated")
                continue
            rows.append(cols)
            cpu = d.reserved_before is None
            rows.append(
                f"    {'RSS' if cpu else 'allocated':<20}{format_bytes(d.allocated_before):>13}"
                f"{format_bytes(d.allocated_after):>13}{_signed(d.allocated_delta):>13}"
                f"{format_bytes(d.peak_allocated):>13}"
            )
            if not cpu:
                rows.append(
                    f"    {'reserved':<20}{format_bytes(d.reserved_before):>13}"
                    f"{format_bytes(d.reserved_after):>13}{_signed(d.reserved_delta):>13}"
                    f"{format_bytes(d.peak_reserved):>13}"
                )
            if d.total is not None:
                rows.append(
                    f"    {'available' if cpu else 'free'} {format_bytes(d.free)} "
                    f"of {format_bytes(d.total)}"
                )
            if d.peak_since_start:
                rows.append("    peak is since process start: this system cannot reset it")
        if self.history:
            rows.append(f"  allocator history: {self.history} (open it at {_MEMORY_VIZ})")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, Any]:
        """Exact numbers as plain JSON-ready data; :meth:`from_dict` reverses it.

        >>> from cudakit.memory import memory_report
        >>> with memory_report(device="cpu", file=None) as rep:
        ...     pass
        >>> sorted(rep.to_dict())
        ['devices', 'elapsed', 'history', 'label', 'raised', 'shared']
        """
        self._devs()
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        out["devices"] = [dataclasses.asdict(d) for d in self.devices]
        return out

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as a JSON string (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        """Rebuild a report from :meth:`to_dict` output."""
        fields = dict(data)
        devices = tuple(DeviceMemory(**d) for d in fields.pop("devices"))
        return cls(devices=devices, done=True, **fields)

    @classmethod
    def from_json(cls, text: str) -> MemoryReport:
        """Rebuild a report from :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class MemorySnapshot:
    """Memory of one device now, from :func:`memory_snapshot` (exact bytes).

    ``peak_*`` are since the last reset: the start of the outermost open
    :func:`memory_report` on that device, else since process start (or the last
    ``torch.cuda.reset_peak_memory_stats``). On the CPU *allocated* is the RSS.

    >>> from cudakit.memory import memory_snapshot
    >>> snap = memory_snapshot("cpu")
    >>> snap.device, snap.reserved, str(snap).startswith("cpu: RSS")
    ('cpu', None, True)

    .. versionadded:: 0.1
    """

    device: str
    allocated: int
    peak_allocated: int
    reserved: int | None = None
    peak_reserved: int | None = None
    free: int | None = None
    total: int | None = None
    cuda_started: bool | None = None

    def __str__(self) -> str:
        if self.cuda_started is False:
            return f"{self.device}: CUDA not started in this process, nothing allocated"
        cpu = self.reserved is None
        s = (
            f"{self.device}: {'RSS' if cpu else 'allocated'} {format_bytes(self.allocated)} "
            f"(peak {format_bytes(self.peak_allocated)})"
        )
        if not cpu:
            s += f", reserved {format_bytes(self.reserved)} "
            s += f"(peak {format_bytes(self.peak_reserved)})"
        if self.total is not None:
            s += f", {'available' if cpu else 'free'} {format_bytes(self.free)} of "
            s += format_bytes(self.total)
        return s

    def to_dict(self) -> dict[str, Any]:
        """Exact numbers as a plain dict."""
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- bookkeeping


class _Frame:
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


_LOCK = threading.Lock()
_OPEN: dict[str, list[_Frame]] = {}
_HISTORY_DEPTH = 0


def _after_fork() -> None:
    global _LOCK, _HISTORY_DEPTH
    _ProcCpu.forks += 1  # reopen /proc/self descriptors: they still name the parent
    _LOCK = threading.Lock()
    _OPEN.clear()
    _HISTORY_DEPTH = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _absorb(frames: list[_Frame], peak_a: int, peak_r: int) -> None:
    for f in frames:
        if peak_a > f.peak_a:
            f.peak_a = peak_a
        if peak_r > f.peak_r:
            f.peak_r = peak_r


def _open_frame(device: str, index: int) -> _Frame:
    """Read the "before" numbers, keep open reports' peaks, reset the peak. Holds _LOCK."""
    me = threading.get_ident()
    frame = _Frame(device, index, me)
    frames = _OPEN.setdefault(device, [])
    for f in frames:
        if f.thread != me:
            f.shared = frame.shared = True
    if index < 0:
        if frames:
            frame.alloc0, peak = _cpu.rss_peak()
            _absorb(frames, peak, 0)
        else:
            frame.alloc0 = _cpu.rss()
        frame.since_start = not _cpu.reset_peak(frame.alloc0)
    elif _cuda.is_initialized():  # else nothing is allocated: keep zeros, start nothing
        frame.alloc0, frame.res0, peak_a, peak_r = _cuda.stats(index)
        _absorb(frames, peak_a, peak_r)
        _cuda.reset_peak(index)
    frames.append(frame)
    return frame


def _close_frame(frame: _Frame) -> DeviceMemory:
    """Read the "after" numbers and pass the peak on to reports still open. Holds _LOCK."""
    frames = _OPEN.setdefault(frame.device, [])
    if frame in frames:  # absent only in a child forked while the report was open
        frames.remove(frame)
    if frame.index < 0:
        rss, peak = _cpu.rss_peak()
        _absorb(frames, peak, 0)
        free, total = _cpu.free_total()
        return DeviceMemory(
            frame.device,
            frame.alloc0,
            rss,
            max(frame.peak_a, peak, rss, frame.alloc0),  # a peak never below either end
            free=free,
            total=total,
            peak_since_start=frame.since_start,
        )
    if not _cuda.is_initialized():
        return DeviceMemory(frame.device, 0, 0, 0, 0, 0, 0, cuda_started=False)
    alloc, res, peak_a, peak_r = _cuda.stats(frame.index)
    _absorb(frames, peak_a, peak_r)
    free, total = _cuda.free_total(frame.index)
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


_CPU_TARGET: Final = (("cpu", -1),)


def _follows_current(device: object) -> bool:
    """Whether ``device=`` means "this thread's current CUDA device" rather than a fixed one."""
    if isinstance(device, torch.device):
        return device.type == "cuda" and device.index is None
    return device is None or (isinstance(device, str) and device in ("auto", "cuda"))


def _targets(device: DeviceLike | Literal["all"], who: str) -> tuple[tuple[str, int], ...]:
    """Resolve ``device=`` to ``((name, cuda_index_or_-1), ...)``."""
    if device == "cpu":
        return _CPU_TARGET
    if isinstance(device, str) and device == "all":
        if not _cuda.is_available() or _cuda.device_count() == 0:
            raise DeviceError(
                f"{who}(device='all') reports every visible CUDA device, but this machine has "
                "none (CUDA is not available). Use device=None to follow resolve_device(), or "
                "device='cpu' for the process's resident memory."
            )
        return tuple((f"cuda:{i}", i) for i in range(_cuda.device_count()))
    dev = resolve_device(device)
    if dev.type == "cuda":
        index = 0 if dev.index is None else dev.index
        return ((f"cuda:{index}", index),)
    if dev.type == "cpu" or device is None or device == "auto":
        # "auto" on a Mac resolves to MPS: fall back quietly to the process's memory.
        return (("cpu", -1),)
    raise DeviceError(
        f"{who}() measures CUDA devices and the CPU process, got device={device!r} ({dev.type}). "
        "Use device='cuda:N', 'all' or 'cpu' (on Apple MPS, 'cpu' reports the process's RSS)."
    )


def _begin_history() -> None:
    """Start the allocator history for the first open ``record_history`` report. Holds _LOCK."""
    global _HISTORY_DEPTH
    if _HISTORY_DEPTH == 0:
        _cuda.start_history()
    _HISTORY_DEPTH += 1


def _end_history() -> None:
    """Stop the allocator history when the last ``record_history`` report closes. Holds _LOCK."""
    global _HISTORY_DEPTH
    _HISTORY_DEPTH = max(0, _HISTORY_DEPTH - 1)
    if _HISTORY_DEPTH == 0:
        _cuda.stop_history()


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(note)


def _explain_oom(exc: BaseException, rep: MemoryReport) -> None:
    """Add what the user needs to act on an out-of-memory error, once per device."""
    noted: set[str] = getattr(exc, "_cudakit_memory_noted", set())
    for d in rep.devices:
        if d.device in noted or d.cuda_started is False:
            continue  # an inner report already explained this device
        noted.add(d.device)
        if d.reserved_before is None:
            _add_note(
                exc,
                f"cudakit.memory_report {rep.label or ''!r} on {d.device}: peak RSS "
                f"{format_bytes(d.peak_allocated)} in this block (RSS "
                f"{format_bytes(d.allocated_before)} at its start); available system "
                f"memory {format_bytes(d.free)} of {format_bytes(d.total)}.",
            )
            continue
        try:
            largest = _cuda.largest_free_block(int(d.device.split(":")[1]))
        except Exception:
            largest = None
        cached = (d.reserved_after or 0) - d.allocated_after
        _add_note(
            exc,
            f"cudakit.memory_report {rep.label or ''!r} on {d.device}: peak allocated "
            f"{format_bytes(d.peak_allocated)} in this block ({_signed(d.peak_increase)} over "
            f"its start); now allocated {format_bytes(d.allocated_after)}, reserved "
            f"{format_bytes(d.reserved_after)} ({format_bytes(cached)} cached but unused); "
            f"largest free cached block {format_bytes(largest)}; device free "
            f"{format_bytes(d.free)} of {format_bytes(d.total)}. If cached-but-unused is "
            "large the cache is fragmented: set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Otherwise lower the batch "
            "size (cudakit.warmup.find_batch_size) or use mixed precision (autocast_step); "
            f"record_history='oom.pickle' shows what held the memory ({_MEMORY_VIZ}).",
        )
    with contextlib.suppress(AttributeError, TypeError):
        exc._cudakit_memory_noted = noted  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- reporter


class _Aggregate:
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
        with self.lock:
            self.calls += 1
            self.last = rep

    def add(self, rep: MemoryReport) -> str | None:
        """Count ``rep``; return the line to write now, if any."""
        with self.lock:
            self.calls += 1
            self.last = rep
            now = _monotonic()
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
                f"allocated Δ mean {_signed(self.delta_sum // self.n)}; time mean "
                f"{_fmt_time(self.time_sum / self.n)}, max {_fmt_time(self.time_max)}"
            )
            if self.shared:
                line += " [shared: another thread used this device meanwhile]"
        self._reset(now)
        return line

    def flush(self) -> str | None:
        with self.lock:
            return self._emit(_monotonic())


class MemoryReported(Protocol[P, R_co]):
    """A function decorated with :func:`memory_report`.

    ``fn.memory_report`` is the :class:`MemoryReporter`: ``.last`` is the most
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

    memory_report: MemoryReporter
    __name__: str
    __qualname__: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...


class MemoryReporter(ContextDecorator):
    """Measures a block (``with``) or every call of a function (``@``); see :func:`memory_report`.

    One object may be entered many times one after the other (a ``with`` inside a
    loop); its output is throttled across those entries. Entering it again while
    it is open raises ``RuntimeError``: nest a new ``memory_report()`` instead.
    ``device=None``, ``"auto"`` and ``"cuda"`` follow the thread's current CUDA
    device at every entry, so an object made before ``torch.cuda.set_device``
    measures the right device.

    >>> from cudakit.memory import memory_report
    >>> lines = []
    >>> step_memory = memory_report("step", device="cpu", log=lines.append, every=2)
    >>> for _ in range(4):
    ...     with step_memory:
    ...         pass
    >>> step_memory.calls, len(lines), lines[0].startswith("memory_report 'step' cpu x2 calls")
    (4, 2, True)

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        label: str | None,
        device: DeviceLike | Literal["all"],
        file: IO[str] | _Stderr | None,
        log: LogTarget | None,
        every: int | None,
        record_history: str | os.PathLike[str] | None,
        *,
        _targets: tuple[tuple[str, int], ...] | None = None,
        _agg: _Aggregate | None = None,
    ) -> None:
        self.label = label
        self._device = device
        self._file = file
        self._log = log
        self._every = every
        self._history = None if record_history is None else os.fspath(record_history)
        self._targets = _targets if _targets is not None else self._resolve()
        self._follow = _follows_current(device)
        self._agg_ = _agg  # created on first use: most `with` reports never need it
        self._frames: list[_Frame] | None = None
        self._report: MemoryReport | None = None
        self._t0 = 0.0

    def _resolve(self) -> tuple[tuple[str, int], ...]:
        targets = _targets(self._device, "memory_report")
        if self._history is not None and any(i < 0 for _, i in targets):
            raise ValueError(
                f"memory_report(record_history={self._history!r}) records the CUDA caching "
                f"allocator, but this report measures {targets[0][0]}. Pass a CUDA device "
                "(device='cuda'), or drop record_history on CPU-only machines."
            )
        return targets

    @property
    def _agg(self) -> _Aggregate:
        agg = self._agg_
        if agg is None:
            agg = self._agg_ = _Aggregate(self._every)
        return agg

    @property
    def last(self) -> MemoryReport | None:
        """The most recent finished report of this object (and its decorator clones)."""
        return self._agg.last

    @property
    def calls(self) -> int:
        """How many blocks or calls this object (and its clones) has measured."""
        return self._agg.calls

    def clone(self) -> Self:
        """A fresh, un-entered reporter with the same settings and the same output throttle."""
        return type(self)(
            self.label,
            self._device,
            self._file,
            self._log,
            self._every,
            self._history,
            _targets=self._targets,
            _agg=self._agg,
        )

    def __call__(self, func: Callable[P, R]) -> MemoryReported[P, R]:
        """Decorate ``func``: every call is measured; output is throttled (see ``every``)."""
        target = self
        if self.label is None and callable(func):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
            target = type(self)(
                None if name is None else str(name).rsplit("<locals>.", 1)[-1],
                self._device,
                self._file,
                self._log,
                self._every,
                self._history,
                _targets=self._targets,
                _agg=self._agg,
            )
        wrapped: Any = ContextDecorator.__call__(target, func)
        wrapped.memory_report = target
        return wrapped  # type: ignore[no-any-return]

    def __enter__(self) -> MemoryReport:
        targets = self._targets
        if self._follow and targets[0][1] >= 0:
            # device=None/"auto"/"cuda" follows this thread's current device, which may
            # have changed since decoration (torch.cuda.set_device(local_rank) in DDP).
            index = _cuda.current_index()
            if index != targets[0][1]:
                targets = self._targets = ((f"cuda:{index}", index),)
        rep = MemoryReport(self.label)
        with _LOCK:
            if self._frames is not None:
                raise RuntimeError(
                    f"this memory_report({self.label or ''!r}) is already open; one object "
                    "measures one block at a time. For a nested block write a new "
                    "`with memory_report(...)`, or decorate the function with @memory_report."
                )
            frames: list[_Frame] = []
            recording = False
            try:
                if self._history is not None:
                    _begin_history()
                    recording = True
                for name, index in targets:
                    frames.append(_open_frame(name, index))
            except BaseException:
                for f in frames:  # leave no half-opened report behind
                    _OPEN[f.device].remove(f)
                if recording:
                    _end_history()
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
        with _LOCK:
            self._frames = None
            self._report = None
            for f in frames:  # _close_frame unregisters the frame before it reads anything
                try:
                    devices.append(_close_frame(f))
                except Exception as e:  # e.g. a sticky CUDA error after a device-side assert
                    read_error = read_error or e
            if self._history is not None:
                try:
                    _cuda.dump_history(self._history)
                except Exception as e:  # report the block anyway, then raise below
                    history_error = e
                finally:
                    _end_history()
        if read_error is not None:
            rep.failed = f"{type(read_error).__name__}: {read_error}"
            msg = (
                f"memory_report {rep.label or ''!r} has no numbers: reading the memory "
                f"counters failed with {rep.failed}"
            )
            if exc is None:
                raise RuntimeError(msg) from read_error
            _add_note(exc, f"cudakit.{msg}")  # the block's own error goes on unchanged
            return
        rep.devices = tuple(devices)
        rep.elapsed = elapsed
        rep.raised = None if exc_type is None else exc_type.__qualname__
        rep.shared = any(f.shared for f in frames)
        rep.history = self._history if history_error is None else None
        rep.done = True
        if exc is not None and is_oom_error(exc):
            _explain_oom(exc, rep)
        if self._file is None and self._log is None:
            self._agg.count(rep)  # silent: keep .last and .calls, format nothing
        else:
            line = self._agg.add(rep)
            if line is not None:
                self._write(line)
        if history_error is not None:
            msg = (
                f"memory_report could not write the allocator history to {self._history!r}: "
                f"{history_error}. Check that the directory exists and is writable."
            )
            if exc is None:
                raise RuntimeError(msg) from history_error
            _add_note(exc, f"cudakit.{msg}")

    def _write(self, line: str) -> None:
        file = self._file
        if isinstance(file, _Stderr):
            file = None if self._log is not None else sys.stderr
        if file is not None:
            file.write(line + "\n")
            flush = getattr(file, "flush", None)
            if flush is not None:
                flush()
        if self._log is not None:
            if isinstance(self._log, logging.Logger):
                self._log.info(line)
            else:
                self._log(line)

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
) -> MemoryReporter: ...


def memory_report(
    label: Callable[P, R] | str | None = None,
    *,
    device: DeviceLike | Literal["all"] = None,
    file: IO[str] | _Stderr | None = _STDERR,
    log: LogTarget | None = None,
    every: int | None = None,
    record_history: str | os.PathLike[str] | None = None,
) -> MemoryReporter | MemoryReported[P, R]:
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
    peak, reserved versus allocated and the largest free cached block.

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

    Returns:
        A :class:`MemoryReporter` (``with`` yields a :class:`MemoryReport`), or the
        decorated function when used as bare ``@memory_report``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``every < 1``, or ``record_history`` on a CPU device.
        DeviceError: the device does not exist or cannot be measured.

    .. versionadded:: 0.1
    """
    if callable(label):
        return MemoryReporter(None, device, file, log, every, record_history)(label)
    if label is not None and not isinstance(label, str):
        raise TypeError(
            f"memory_report(label) takes a string naming the block, got "
            f"{type(label).__name__} {label!r}. For example: memory_report('train_step')."
        )
    if (
        file is not None
        and not isinstance(file, _Stderr)
        and not callable(getattr(file, "write", None))
    ):
        raise TypeError(
            f"memory_report(file=...) takes a text stream with .write() (sys.stdout, an open "
            f"file) or None to stay silent, got {type(file).__name__} {file!r}. To send lines "
            "to a logger or function, use log=."
        )
    if log is not None and not isinstance(log, logging.Logger) and not callable(log):
        raise TypeError(
            "memory_report(log=...) takes a logging.Logger or a callable that accepts the line, "
            f"got {type(log).__name__} {log!r}. For example: log=logging.getLogger(__name__)."
        )
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int):
            raise TypeError(
                f"memory_report(every=...) takes a whole number of calls, got "
                f"{type(every).__name__} {every!r}. For example: every=100."
            )
        if every < 1:
            raise ValueError(
                f"memory_report(every={every}) must be at least 1 (1 writes a line for every "
                "call). Use file=None to silence the output instead."
            )
    if record_history is not None and not isinstance(record_history, (str, os.PathLike)):
        raise TypeError(
            "memory_report(record_history=...) takes a file path for the allocator snapshot, "
            f"got {type(record_history).__name__} {record_history!r}. "
            "For example: record_history='step.pickle'."
        )
    return MemoryReporter(label, device, file, log, every, record_history)


@overload
def memory_snapshot(device: Literal["all"]) -> list[MemorySnapshot]: ...  # type: ignore[overload-overlap]


@overload
def memory_snapshot(device: DeviceLike = None) -> MemorySnapshot: ...


def memory_snapshot(
    device: DeviceLike | Literal["all"] = None,
) -> MemorySnapshot | list[MemorySnapshot]:
    """Return the memory of a device now, without resetting any peak.

    >>> from cudakit.memory import memory_snapshot
    >>> snap = memory_snapshot("cpu")
    >>> snap.device, snap.allocated > 0, snap.peak_allocated >= snap.allocated
    ('cpu', True, True)

    Args:
        device: as in :func:`memory_report`: ``None``, ``"cuda:N"``, ``"cpu"`` or
            ``"all"`` (every visible CUDA device, returned as a list).

    Returns:
        A :class:`MemorySnapshot`, or a list of them for ``device="all"``.

    Raises:
        DeviceError: the device does not exist or cannot be measured.

    .. versionadded:: 0.1
    """
    out: list[MemorySnapshot] = []
    for name, index in _targets(device, "memory_snapshot"):
        with _LOCK:
            frames = _OPEN.get(name, [])
            seen_a = max((f.peak_a for f in frames), default=0)
            seen_r = max((f.peak_r for f in frames), default=0)
            if index < 0:
                rss, peak = _cpu.rss_peak()
                free, total = _cpu.free_total()
                out.append(
                    MemorySnapshot(name, rss, max(peak, seen_a, rss), free=free, total=total)
                )
            elif not _cuda.is_initialized():
                out.append(MemorySnapshot(name, 0, 0, 0, 0, cuda_started=False))
            else:
                alloc, res, peak_a, peak_r = _cuda.stats(index)
                free, total = _cuda.free_total(index)
                out.append(
                    MemorySnapshot(
                        name,
                        alloc,
                        max(peak_a, seen_a),
                        res,
                        max(peak_r, seen_r),
                        free,
                        total,
                        cuda_started=True,
                    )
                )
    if isinstance(device, str) and device == "all":
        return out
    return out[0]
