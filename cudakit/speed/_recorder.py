"""What a meter and its clones share: the calls recorded, the figures, and the line.

:class:`Recorder` turns a finished call into a record of the tally (deciding whether
it closed an optimizer step), builds :class:`SpeedFigures` from the tally's sums and
the device's peak, and writes the line at the log interval, combined across ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from .._accel import current_cuda_index
from .._dist import group_rank
from .._output import write_line
from ..amp import AutocastStep, StepResult
from . import _probes
from ._args import Settings
from ._clock import clock_for
from ._combine import combine, group_ranks
from ._tally import Sums, Tally
from .counts import Count
from .figures import SpeedFigures, SpeedSummary
from .peaks import Peak, dtype_key, lookup_peak

__all__ = ["Recorder"]


class Recorder:
    """What a meter and its clones share: the tally, the output and the last figures."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.tally = Tally(clock_for(settings.device), settings.window, settings.start)
        self._every = settings.every
        self._accumulate = settings.accumulate
        #: The name in the line (a decorator's default: the function's name).
        self.label = settings.label
        #: The autocast_step whose windows are the steps (given, or the decorated one's).
        self.step = settings.step
        #: Its accumulation window (``step.window``), bound once: each call reads its
        #: position without a property call.
        self.window: Any = settings.step.window if settings.step is not None else None
        #: The last line written, and the all-rank figures of the last log point.
        self.last_line: str | None = None
        self.combined: SpeedSummary | None = None
        self.logged_at = settings.start  # the step of the last line
        #: The values :meth:`SpeedMeter.show` was given (numbers, tensors, functions),
        #: read only when a line is written.
        self.shown: dict[str, Any] = {}
        #: The advices (why there is no MFU) a line has said: each is said once.
        self.said: set[str] = set()
        #: A line is due: a read closed a flushed window at a log step (written at the
        #: next call, as reads make no collective call).
        self.due = False

    def record(
        self, mark: Any, counts: tuple[Count, Count, Count], out: Any, before: int, step: Any
    ) -> None:
        """Count one finished call, and write the line when a log step is reached."""
        tally = self.tally
        if step is not None:
            if before == 0 and (tally.open_calls or self.due):
                self.end_flushed()  # the window was stepped between calls (flush())
            ends = self.window.position == 0  # (step.position, without the property call)
        elif isinstance(out, StepResult):
            # A window's last call carries a verdict (a bool, or a lazy Verdict: never read).
            ends = out.stepped is not False or out.skipped is not False
        elif self._accumulate is not None:
            ends = tally.open_calls + 1 >= self._accumulate
        else:
            ends = True
        s, t, f = counts
        if tally.add(mark, s, t, f, ends) and self._every and tally.steps % self._every == 0:
            self.log(out)

    def end_flushed(self) -> None:
        """Close the open step, stepped outside the meter (``flush()``); a line if it is due."""
        self.close_flushed(ended=True)
        if self.due:
            self.log()

    # ------------------------------------------------------------------ figures

    def device(self) -> torch.device:
        s = self.settings
        return torch.device("cuda", current_cuda_index()) if s.follow else s.device

    def peak(self, step: AutocastStep | None) -> Peak:
        """The peak the MFU is measured against, or why there is none."""
        s = self.settings
        dtype = s.dtype
        if dtype is None:
            dtype = step.dtype if step is not None else torch.float32
        key = dtype_key(dtype) or str(dtype)
        device = self.device()
        tf32 = dtype is torch.float32 and device.type == "cuda" and _probes.tf32_matmuls()
        if tf32:
            key = "tf32"  # torch.set_float32_matmul_precision("high") runs TF32 matmuls
        if s.peak_tflops is not None:
            return Peak(s.peak_tflops, "given", key, "peak_tflops=")
        name = _probes.device_name(device)
        if name is not None:
            peak = lookup_peak(name, key)
            if tf32 and peak.tflops is None and peak.model is not None:
                peak = lookup_peak(name, "fp32")  # a GPU without TF32 (V100, T4): fp32 rate
            return peak
        if device.type == "cuda":
            why = "CUDA has not started in this process, so the GPU is not known yet"
        else:
            why = f"the peak table covers NVIDIA GPUs, not {device.type}"
        return Peak(None, None, key, reason=f"{why}; pass peak_tflops=... to get an MFU")

    def final(self, sums: Sums) -> Sums:
        """``sums`` with its FLOPs as this rank's rule makes them (see ``CallCounter``)."""
        flops = self.settings.counter.flops_of(sums.calls, sums.samples, sums.tokens, sums.flops)
        return Sums(sums.steps, sums.calls, sums.seconds, sums.samples, sums.tokens, flops)

    def figures(
        self,
        sums: Sums,
        peak: Peak,
        ranks: int = 1,
        peaks: float | None = None,
        missing: tuple[int, ...] = (),
    ) -> SpeedFigures:
        """Figures of final ``sums`` against ``peak`` (or ``peaks``, the ranks' summed)."""
        counter = self.settings.counter
        flops = sums.flops if counter.has_flops else None
        tflops = peak.tflops if ranks == 1 else peaks
        reason = peak.reason
        if missing:
            tflops = None
            which = ", ".join(map(str, missing))
            reason = f"rank(s) {which} have no peak" + (
                f" ({reason})" if reason else "; pass peak_tflops=... on every rank"
            )
        if flops is None:
            tflops = None
            reason = (
                "no FLOP count; pass flops=count_flops(...) (or a number per call, or a "
                "function of the batch)"
            )
        source = None if peak.source is None else f"{peak.model}, {peak.dtype}: {peak.source}"
        return SpeedFigures(
            sums.steps,
            sums.calls,
            sums.seconds,
            sums.samples if counter.samples is not None else None,
            sums.tokens if counter.tokens is not None else None,
            flops,
            tflops,
            source if tflops is not None else None,
            None if tflops is not None else reason,
            ranks,
        )

    def close_flushed(self, ended: bool = False) -> None:
        """Close the open window if its step was stepped since (``flush()``); no read.

        ``ended``: the caller saw it stepped (a call that starts a new window).
        """
        step, tally = self.step, self.tally
        if tally.open_calls and (ended or (step is not None and step.position == 0)):
            tally.end_window()
            if self._every and tally.steps % self._every == 0:
                self.due = True

    def _settle(self) -> None:
        self.close_flushed()
        self.tally.resolve()

    def summary(self) -> SpeedSummary:
        """This rank's figures now (reads the pending records; no collective)."""
        tally = self.tally
        self._settle()
        peak = self.peak(self.step)
        return SpeedSummary(
            tally.steps,
            self.figures(self.final(tally.recent()), peak),
            self.figures(self.final(tally.total()), peak),
        )

    def move_to(self, step: int) -> None:
        """Count on from optimizer step ``step`` (a resumed run's); the figures stay."""
        before = self.tally.steps
        self.tally.move_to(step)
        self.logged_at += step - before

    def read_shown(self, output: Any = None) -> dict[str, float]:
        """The values shown, read now (a tensor from its device, a function called);
        first the loss of ``output`` (the call's return value) with ``loss=True``."""
        out: dict[str, float] = {}
        shown = self.shown
        if self.settings.loss and output is not None:
            loss = output.loss if isinstance(output, StepResult) else output
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                shown = {"loss": loss, **shown}
        for name, value in shown.items():
            try:
                got = value() if callable(value) else value
                out[name] = float(got.item() if isinstance(got, torch.Tensor) else got)
            except Exception as exc:
                exc.add_note(f"cudakit.speed_report could not read show({name}=...) for its line")
                raise
        return out

    def head(self) -> str:
        label = self.label
        return "speed_report" + (f" {label!r}" if label else "") + f" {self.device()}"

    def log(self, output: Any = None) -> None:
        """Write the line: every rank's figures combined when a group runs (a collective).

        ``output``: the return value of the call that reached the log step.
        """
        tally = self.tally
        self.close_flushed()
        self.due = False
        self.logged_at = tally.steps
        combined = self.settings.combine and group_ranks() > 1
        if combined:
            self._settle()
            peak = self.peak(self.step)
            both = combine(self.final(tally.recent()), self.final(tally.total()), peak.tflops)
            missing = tuple(both.missing)
            summary = SpeedSummary(
                tally.steps,
                self.figures(both.recent, peak, both.ranks, both.peak, missing),
                self.figures(both.total, peak, both.ranks, both.peak, missing),
            )
            self.combined = summary
        else:
            summary = self.summary()
        reason = summary.recent.mfu_reason
        advise = reason is not None and reason not in self.said
        line = summary.line(self.head(), values=self.read_shown(output), advice=advise)
        if advise and summary.recent.steps:
            self.said.add(reason)  # type: ignore[arg-type]
        self.last_line = line
        s = self.settings
        if s.file is None and s.log is None:
            return
        if combined and group_rank() != 0:
            return  # every rank's figures in one line: rank 0 writes it
        try:
            write_line(line, s.file, s.log)
        except Exception as exc:
            exc.add_note(f"cudakit.speed_report could not write its line to {s.file!r}")
            raise
