"""What :func:`~cudakit.warmup.warmup` measured: :class:`WarmupReport`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._units import format_bytes

__all__ = ["WarmupReport"]


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warmup` measured.

    Times are wall-clock seconds per pass (CUDA synchronised around each pass);
    memory figures are bytes, ``None`` where not measured (without passes, or on a
    device ``memory_report`` does not measure, such as MPS).

    >>> from cudakit.warmup import WarmupReport
    >>> r = WarmupReport(torch.device("cpu"), 2, True, (0.5, 0.1), None, None, None)
    >>> round(r.speedup, 1), r.first_pass_s, r.last_pass_s
    (5.0, 0.5, 0.1)

    Attributes:
        device: The device warmed up.
        steps: Number of passes run.
        backward: Whether the passes ran backward too.
        pass_times: Seconds of each pass, in order.
        peak_allocated: Peak memory during the last pass (the memory one step needs,
            weights included), as ``memory_report`` measures it: CUDA allocated bytes
            on a GPU, the process's resident set size (RSS) on the CPU; ``None``
            elsewhere.
        reserved_after: CUDA: bytes held by the caching allocator after the call.
        reserve_requested: Bytes ``reserve=`` asked the allocator to hold, if given.

    .. versionadded:: 0.1
    """

    device: torch.device
    steps: int
    backward: bool
    pass_times: tuple[float, ...]
    peak_allocated: int | None
    reserved_after: int | None
    reserve_requested: int | None

    @property
    def first_pass_s(self) -> float | None:
        """Seconds of the first pass, ``None`` without passes."""
        return self.pass_times[0] if self.pass_times else None

    @property
    def last_pass_s(self) -> float | None:
        """Seconds of the last pass, ``None`` without passes."""
        return self.pass_times[-1] if self.pass_times else None

    @property
    def speedup(self) -> float | None:
        """First-pass time over last-pass time: the warm-up effect."""
        if not self.pass_times or self.pass_times[-1] <= 0:
            return None
        return self.pass_times[0] / self.pass_times[-1]

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable dict of the report."""
        return {
            "device": str(self.device),
            "steps": self.steps,
            "backward": self.backward,
            "pass_times": list(self.pass_times),
            "first_pass_s": self.first_pass_s,
            "last_pass_s": self.last_pass_s,
            "speedup": self.speedup,
            "peak_allocated": self.peak_allocated,
            "reserved_after": self.reserved_after,
            "reserve_requested": self.reserve_requested,
        }

    def __str__(self) -> str:
        kind = "forward+backward" if self.backward else "forward"
        lines = [f"warmup on {self.device}: {self.steps} {kind} pass(es)"]
        if self.pass_times:
            lines.append(
                f"  first pass {self.pass_times[0] * 1e3:.2f} ms, last pass "
                f"{self.pass_times[-1] * 1e3:.2f} ms (x{self.speedup or float('nan'):.1f})"
            )
        na = "not measured on " + self.device.type
        peak = format_bytes(self.peak_allocated) if self.peak_allocated is not None else na
        what = "peak RSS of the process" if self.device.type == "cpu" else "peak allocated"
        lines.append(f"  {what} in one step: {peak}")
        reserved = format_bytes(self.reserved_after) if self.reserved_after is not None else na
        lines.append(f"  reserved by the caching allocator after: {reserved}")
        return "\n".join(lines)
