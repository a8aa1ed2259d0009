"""What the demo measured: :class:`EpochStats` per epoch and the :class:`DemoSummary` table."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

from .._units import format_bytes
from ..speed.figures import format_rate
from .data import NUM_CLASSES

__all__ = ["DemoSummary", "EpochStats"]

#: The summary's width: a terminal's 80 columns (and the docs' code blocks).
WIDTH = 80


@dataclass
class EpochStats:
    """What one epoch of the demo measured (on this rank, samples/s for all ranks).

    .. versionadded:: 0.1
    """

    epoch: int
    train_loss: float
    val_loss: float
    val_accuracy: float
    samples_per_s: float
    seconds: float
    optimizer_steps: int
    skipped_steps: int
    peak_memory: int | None
    memory_kind: str
    #: Seconds per optimizer step, achieved TFLOP/s and MFU (all ranks), from
    #: ``speed_report``; None where not measured (MFU: no peak for the device).
    step_time: float | None = None
    tflops: float | None = None
    mfu: float | None = None


@dataclass
class DemoSummary:
    """The demo's result: the set-up it chose and one :class:`EpochStats` per epoch.

    ``str(summary)`` is the table ``cudakit demo`` prints; ``to_dict()`` is what
    ``--json`` prints.

    .. versionadded:: 0.1
    """

    device: str
    dtype: str
    strategy: str
    world_size: int
    batch_size: int
    accumulate: int
    max_grad_norm: float
    train_samples: int
    val_samples: int
    seed: int
    warmup_first_pass_s: float | None
    warmup_last_pass_s: float | None
    first_loss: float
    final_loss: float
    final_accuracy: float
    epochs: list[EpochStats] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list, repr=False)
    step_memory: list[int] = field(default_factory=list, repr=False)
    #: The checkpoint ``--resume`` continued from (None: a fresh start).
    resumed_from: str | None = None
    #: Why the epochs have no MFU (``speed_report``'s ``mfu_reason``), or None.
    mfu_reason: str | None = None

    @property
    def loss_fell(self) -> bool:
        """Whether training lowered the loss (last steps against the first ones)."""
        return self.final_loss < self.first_loss

    @property
    def steps_skipped(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient, all epochs."""
        return sum(e.skipped_steps for e in self.epochs)

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-ready data (per-step series omitted)."""
        out = asdict(self)
        del out["step_losses"], out["step_memory"]
        out["loss_fell"] = self.loss_fell
        out["steps_skipped"] = self.steps_skipped
        return out

    def __str__(self) -> str:
        warm = (
            f"{self.warmup_first_pass_s * 1e3:.1f} ms first pass, "
            f"{self.warmup_last_pass_s * 1e3:.1f} ms last pass"
            if self.warmup_first_pass_s is not None and self.warmup_last_pass_s is not None
            else "skipped"
        )
        head = [
            ("device", self.device),
            ("dtype", self.dtype),
            ("parallel", f"{self.strategy} ({_plural(self.world_size, 'process')})"),
            (
                "batch",
                f"{self.batch_size} per process x {self.accumulate} accumulated, "
                f"clip {self.max_grad_norm}",
            ),
            ("data", f"{self.train_samples} train / {self.val_samples} held-out images"),
            ("warm-up", warm),
            ("steps skipped", str(self.steps_skipped)),
        ]
        if self.resumed_from is not None:
            head.append(("resumed from", self.resumed_from))
        if self.mfu_reason is not None:
            head.append(("MFU", f"n/a: {self.mfu_reason}"))
        width = max(len(k) for k, _ in head)
        lines = []
        for k, v in head:  # a long value wraps under itself (a path stays whole)
            wrapped = textwrap.wrap(
                v, WIDTH - width - 2, break_long_words=False, break_on_hyphens=False
            )
            lines.append(f"{k:<{width}}  {wrapped[0] if wrapped else ''}")
            lines.extend(" " * (width + 2) + more for more in wrapped[1:])
        cols = (
            "epoch",
            "train loss",
            "val loss",
            "val acc",
            "samples/s",
            "FLOP/s",
            "MFU",
            "peak mem",
            "skipped",
        )
        rows = [
            (
                str(e.epoch),
                f"{e.train_loss:.4f}",
                f"{e.val_loss:.4f}",
                f"{e.val_accuracy:.1%}",
                f"{e.samples_per_s:,.0f}",
                "n/a" if e.tflops is None else format_rate(e.tflops * 1e12),
                "n/a" if e.mfu is None else f"{e.mfu:.1%}",
                format_bytes(e.peak_memory) + (" RSS" if e.memory_kind == "rss" else ""),
                str(e.skipped_steps),
            )
            for e in self.epochs
        ]
        for part in _parts([max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(cols)]):
            # A table wider than the terminal goes in parts, each with the epoch first.
            lines.append("")
            lines.append("  ".join(cols[i].rjust(w) for i, w in part))
            lines.append("  ".join("-" * w for _, w in part))
            lines.extend("  ".join(r[i].rjust(w) for i, w in part) for r in rows)
        lines.append("")
        if not self.epochs:
            lines.append(
                f"nothing left to train: {self.resumed_from} had finished every epoch; "
                f"held-out accuracy {self.final_accuracy:.1%}"
            )
            return "\n".join(lines)
        verdict = "fell" if self.loss_fell else "did NOT fall"
        lines.append(
            f"loss {verdict}: {self.first_loss:.4f} -> {self.final_loss:.4f}; "
            f"final held-out accuracy {self.final_accuracy:.1%} (chance: {1 / NUM_CLASSES:.0%})"
        )
        return "\n".join(lines)


def _parts(widths: list[int]) -> list[list[tuple[int, int]]]:
    """The table's columns as (index, width) parts of at most WIDTH, column 0 in each.

    Packed greedily; two parts are balanced instead (the split with the narrower
    wider part), so the last part is not a lone column.
    """

    def span(part: list[tuple[int, int]]) -> int:
        return sum(w for _, w in part) + 2 * (len(part) - 1)

    first = (0, widths[0])
    columns = list(enumerate(widths))[1:]
    parts: list[list[tuple[int, int]]] = [[first]]
    for column in columns:
        if len(parts[-1]) > 1 and span([*parts[-1], column]) > WIDTH:
            parts.append([first])
        parts[-1].append(column)
    if len(parts) == 2:
        splits = [([first, *columns[:k]], [first, *columns[k:]]) for k in range(1, len(columns))]
        fitting = [s for s in splits if max(map(span, s)) <= WIDTH]
        if fitting:
            parts = list(min(fitting, key=lambda s: max(map(span, s))))
    return parts


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"
