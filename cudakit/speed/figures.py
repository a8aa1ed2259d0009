"""The meter's figures (:class:`SpeedFigures`, :class:`SpeedSummary`) and their one line."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .._units import format_seconds

__all__ = ["SpeedFigures", "SpeedSummary", "format_rate"]

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def format_rate(x: float, unit: str = "", *, space: bool = False) -> str:
    """A number with an SI prefix and three significant digits, then ``unit``.

    >>> format_rate(2603.4), format_rate(1.33e6)
    ('2.60k', '1.33M')
    >>> format_rate(12.0), format_rate(0.5)
    ('12.0', '0.500')
    >>> format_rate(4.52e13, "FLOP/s", space=True)
    '45.2 TFLOP/s'
    >>> format_rate(1.54e7, "FLOP/s", space=True)
    '15.4 MFLOP/s'
    """
    prefix = ""
    for scale, name in _PREFIXES:
        if abs(x) >= scale * 0.9995:  # 999.7 shows as 1.00k, not 1000
            x, prefix = x / scale, name
            break
    if x == 0:
        number = "0"
    elif abs(x) >= 99.95:
        number = f"{x:.0f}"
    elif abs(x) < 0.001:
        number = f"{x:.2e}"
    else:
        number = f"{x:#.3g}"
    return f"{number}{' ' if space else ''}{prefix}{unit}"


@dataclass(frozen=True)
class SpeedFigures:
    """Throughput over a span of optimizer steps: counts, time, rates, TFLOP/s and MFU.

    Counts are sums over the span (and over the ranks, for combined figures); the
    time is the measured time of the span's calls (the slowest rank's, combined).
    A figure the meter was not told how to count is None, and so is every rate
    before the first step. MFU is None without a peak; :attr:`mfu_reason` says why.

    >>> f = SpeedFigures(steps=10, calls=20, seconds=2.0, samples=640, tokens=None,
    ...                  flops=4e12, peak_tflops=4.0)
    >>> f.step_time, f.samples_per_s, f.tokens_per_s, f.tflops, f.mfu
    (0.2, 320.0, None, 2.0, 0.5)

    .. versionadded:: 0.1
    """

    #: Optimizer steps (accumulation windows) in the span.
    steps: int
    #: Calls (micro-batches) in the span, over all ranks when combined.
    calls: int
    #: Seconds the span's calls took (the slowest rank's, when combined).
    seconds: float
    #: Samples in the span, or None when ``samples=`` was not given.
    samples: float | None
    #: Tokens in the span, or None when ``tokens=`` was not given.
    tokens: float | None
    #: FLOPs in the span, or None when ``flops=`` was not given.
    flops: float | None
    #: Dense peak TFLOP/s the figures are measured against (summed over ranks), or None.
    peak_tflops: float | None = None
    #: Where the peak comes from (``"H100 SXM, bf16: NVIDIA H100 ... datasheet"``), or None.
    peak_source: str | None = None
    #: Why there is no MFU, or None when there is one.
    mfu_reason: str | None = None
    #: Ranks whose figures are combined (1: this process alone).
    ranks: int = 1

    def _rate(self, count: float | None) -> float | None:
        if count is None or self.steps == 0 or self.seconds <= 0:
            return None
        return count / self.seconds

    @property
    def step_time(self) -> float | None:
        """Seconds per optimizer step."""
        return self.seconds / self.steps if self.steps and self.seconds > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second."""
        return self._rate(self.samples)

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second."""
        return self._rate(self.tokens)

    @property
    def tflops(self) -> float | None:
        """Achieved TFLOP/s (10**12 FLOPs per second)."""
        rate = self._rate(self.flops)
        return None if rate is None else rate / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved over peak FLOP/s, a fraction (0.45 is 45 %)."""
        tflops = self.tflops
        if tflops is None or self.peak_tflops is None:
            return None
        return tflops / self.peak_tflops

    def to_dict(self) -> dict[str, Any]:
        """Every field and rate, JSON-ready."""
        out = asdict(self)
        for name in ("step_time", "samples_per_s", "tokens_per_s", "tflops", "mfu"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        """``"12.3 ms/step, 2.60k samples/s, 45.2 TFLOP/s, MFU 45.7%"`` (what is known)."""
        step_time = self.step_time
        if step_time is None:
            return "no step measured yet"
        parts = [f"{format_seconds(step_time)}/step"]
        for rate, unit in ((self.samples_per_s, "samples/s"), (self.tokens_per_s, "tokens/s")):
            if rate is not None:
                parts.append(f"{format_rate(rate)} {unit}")
        tflops = self.tflops
        if tflops is not None:
            parts.append(format_rate(tflops * 1e12, "FLOP/s", space=True))
        mfu = self.mfu
        if mfu is not None:
            text = f"MFU {mfu:.1%}"
            if mfu > 1:
                text += " (above 100%: is dtype= the one the step runs in?)"
            parts.append(text)
        return ", ".join(parts)


@dataclass(frozen=True)
class SpeedSummary:
    """The meter's figures at one moment: the rolling window and everything since the start.

    .. versionadded:: 0.1
    """

    #: The optimizer step the figures reach (counted on from ``speed_report(start=)``).
    step: int
    #: The last ``window`` optimizer steps.
    recent: SpeedFigures
    #: Every optimizer step so far.
    total: SpeedFigures

    def line(
        self, head: str, *, values: Mapping[str, float] | None = None, advice: bool = True
    ) -> str:
        """The log line: ``head``, the values shown, the rolling window, the total, and
        the MFU's note (why there is none: only with ``advice``).

        >>> f = SpeedFigures(steps=2, calls=2, seconds=1.0, samples=64, tokens=None,
        ...                  flops=None, mfu_reason="no FLOP count")
        >>> summary = SpeedSummary(8, f, f)
        >>> summary.line("speed_report", values={"loss": 2.5}, advice=False)
        'speed_report step 8: loss 2.5, 500.0 ms/step, 64.0 samples/s [last 2 steps]'
        """
        recent, total = self.recent, self.total
        ranks = f" x{recent.ranks} ranks" if recent.ranks > 1 else ""
        shown = "".join(f"{name} {value:.4g}, " for name, value in (values or {}).items())
        line = f"{head}{ranks} step {self.step}: {shown}{recent.summary()}"
        line += f" [last {recent.steps} steps]"
        if total.steps != recent.steps:
            line += f"; all {total.steps} steps: {total.summary()}"
        if recent.mfu_reason is not None:
            if advice and recent.steps:
                line += f"; MFU n/a: {recent.mfu_reason}"
        elif recent.peak_source is not None and recent.mfu is not None:
            line += f" (peak {recent.peak_tflops:g} TFLOP/s, {recent.peak_source})"
        return line
