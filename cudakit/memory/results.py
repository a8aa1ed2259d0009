"""What a report found: :class:`DeviceMemory`, :class:`MemoryReport`, :class:`MemorySnapshot`.

Plain data with one renderer, :func:`render`, that writes the text of all three: the
one-line summary of a block, the table of ``str(report)`` and the line of a snapshot.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from typing import Any, Final, Literal

from .._units import format_bytes, format_seconds, format_signed_bytes
from ._schema import load_json, read_report

__all__ = [
    "MEMORY_VIZ",
    "DeviceMemory",
    "MemoryReport",
    "MemorySnapshot",
    "ReportFigures",
    "combine",
    "render",
]

#: Where an allocator history snapshot can be opened.
MEMORY_VIZ: Final = "https://pytorch.org/memory_viz"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What one device's memory did during one block (exact bytes).

    On CUDA, *allocated* is memory held by tensors and *reserved* is what the
    caching allocator holds from the driver. On the CPU, *allocated* is the
    process's resident set size (RSS) and the reserved fields are ``None``.

    >>> from cudakit.memory import DeviceMemory
    >>> d = DeviceMemory(
    ...     "cpu", allocated_before=10, allocated_after=4, peak_allocated=30
    ... )
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
        return render(self, "line")[0]


def _sum(values: list[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def combine(devices: tuple[DeviceMemory, ...]) -> DeviceMemory:
    """One device's figures as they are; several devices' figures summed."""
    if len(devices) == 1:
        return devices[0]
    return DeviceMemory(
        ", ".join(d.device for d in devices),
        sum(d.allocated_before for d in devices),
        sum(d.allocated_after for d in devices),
        sum(d.peak_allocated for d in devices),
        _sum([d.reserved_before for d in devices]),
        _sum([d.reserved_after for d in devices]),
        _sum([d.peak_reserved for d in devices]),
        _sum([d.free for d in devices]),
        _sum([d.total for d in devices]),
    )


Layout = Literal["line", "now", "table"]
_TABLE_HEAD: Final = f"  {'':<22}{'before':>13}{'after':>13}{'delta':>13}{'peak':>13}"


def render(d: DeviceMemory, layout: Layout) -> list[str]:
    """The text for one device: the one renderer of every memory report.

    ``"line"``: one line for a block (peak, before → after, free);
    ``"now"``: one line for a snapshot (``after`` is now, no before);
    ``"table"``: the rows of ``str(report)``, one per quantity.
    """
    if d.cuda_started is False:
        text = "CUDA not started in this process, nothing allocated"
        return [f"    {text}" if layout == "table" else f"{d.device}: {text}"]
    cpu = d.reserved_before is None
    what = "RSS" if cpu else "allocated"
    rows = [(what, d.allocated_before, d.allocated_after, d.peak_allocated)]
    if d.reserved_before is not None and d.reserved_after is not None:
        rows.append(("reserved", d.reserved_before, d.reserved_after, d.peak_reserved or 0))
    if layout == "table":
        parts = [_TABLE_HEAD] + [
            f"    {name:<20}{format_bytes(b):>13}{format_bytes(a):>13}"
            f"{format_signed_bytes(a - b):>13}{format_bytes(p):>13}"
            for name, b, a, p in rows
        ]
    elif layout == "now":
        parts = [f"{name} {format_bytes(a)} (peak {format_bytes(p)})" for name, _, a, p in rows]
    else:
        parts = [f"peak {format_bytes(d.peak_allocated)} ({format_signed_bytes(d.peak_increase)})"]
        for name, b, a, p in rows:
            peak = f", peak {format_bytes(p)}" if name == "reserved" else ""
            parts.append(
                f"{name} {format_bytes(b)} → {format_bytes(a)} ({format_signed_bytes(a - b)}{peak})"
            )
    if d.total is not None:
        kind = "available" if cpu else "free"
        parts.append(f"{kind} {format_bytes(d.free)} of {format_bytes(d.total)}")
    if d.peak_since_start:
        parts.append("peak RSS since process start (cannot reset it here)")
    if layout == "table":
        return [f"  {d.device}", *(p if p.startswith("  ") else f"    {p}" for p in parts)]
    return [f"{d.device}: {', '.join(parts)}"]


class ReportFigures(ABC):
    """The figures of a finished block, read from :meth:`figures` (every device summed)."""

    @abstractmethod
    def figures(self) -> DeviceMemory:
        """The block's figures; ``RuntimeError`` while there are none."""

    @property
    def device(self) -> str:
        """The device measured (``"cuda:0"``, ``"cpu"``) or a comma-joined list."""
        return self.figures().device

    @property
    def peak_allocated(self) -> int:
        """Peak allocated bytes inside the block (CPU: peak RSS)."""
        return self.figures().peak_allocated

    @property
    def peak_reserved(self) -> int | None:
        """Peak reserved bytes inside the block (``None`` on the CPU)."""
        return self.figures().peak_reserved

    @property
    def allocated_before(self) -> int:
        """Allocated bytes when the block started (CPU: RSS)."""
        return self.figures().allocated_before

    @property
    def allocated_after(self) -> int:
        """Allocated bytes when the block ended (CPU: RSS)."""
        return self.figures().allocated_after

    @property
    def allocated_delta(self) -> int:
        """Allocated bytes the block left behind (negative if it freed memory)."""
        return self.figures().allocated_delta

    @property
    def reserved_before(self) -> int | None:
        """Reserved bytes when the block started (``None`` on the CPU)."""
        return self.figures().reserved_before

    @property
    def reserved_after(self) -> int | None:
        """Reserved bytes when the block ended (``None`` on the CPU)."""
        return self.figures().reserved_after

    @property
    def reserved_delta(self) -> int | None:
        """Reserved bytes the block added to the allocator's cache."""
        return self.figures().reserved_delta

    @property
    def peak_increase(self) -> int:
        """Peak allocated minus allocated at the start: what the block needed on top."""
        return self.figures().peak_increase

    @property
    def free(self) -> int | None:
        """Free device memory at the end (CPU: available system memory)."""
        return self.figures().free

    @property
    def total(self) -> int | None:
        """Total device memory (CPU: total system memory)."""
        return self.figures().total


@dataclasses.dataclass(eq=True)
class MemoryReport(ReportFigures):
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

    def figures(self) -> DeviceMemory:
        """The block's figures: the device's, or the sum over :attr:`devices`.

        .. versionadded:: 0.1
        """
        return combine(self._devs())

    def line(self) -> str:
        """The concise one-line summary printed on exit."""
        devs = self._devs()
        head = "memory_report" + (f" {self.label!r}" if self.label else "")
        body = " | ".join(render(d, "line")[0] for d in devs)
        tail = f", {format_seconds(self.elapsed)}"
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
            f"  time {format_seconds(self.elapsed)}"
            + (f", raised {self.raised}" if self.raised else "")
            + (
                ", SHARED with another thread (numbers include its allocations)"
                if self.shared
                else ""
            ),
        ]
        for d in self.devices:
            rows += render(d, "table")
        if self.history:
            rows.append(f"  allocator history: {self.history} (open it at {MEMORY_VIZ})")
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
        """Rebuild a report from :meth:`to_dict` output.

        Every field is checked first; a wrong one is named, e.g. ``'devices[0].free'``.

        Raises:
            TypeError: ``data`` is not a dict, or a field holds the wrong kind of value.
            ValueError: a field is missing, unknown, or out of range (negative bytes).
        """
        fields, devices = read_report(data)
        return cls(devices=tuple(DeviceMemory(**d) for d in devices), done=True, **fields)

    @classmethod
    def from_json(cls, text: str | bytes) -> MemoryReport:
        """Rebuild a report from :meth:`to_json` output.

        Raises:
            TypeError: ``text`` is not a string, or a field holds the wrong kind of value.
            ValueError: ``text`` is not JSON, or a field is missing, unknown or out of range.
        """
        return cls.from_dict(load_json(text))  # type: ignore[arg-type]  # checked there


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
        now = DeviceMemory(
            self.device,
            self.allocated,
            self.allocated,
            self.peak_allocated,
            self.reserved,
            self.reserved,
            self.peak_reserved,
            self.free,
            self.total,
            self.cuda_started,
        )
        return render(now, "now")[0]

    def to_dict(self) -> dict[str, Any]:
        """Exact numbers as a plain dict."""
        return dataclasses.asdict(self)
