"""``cudakit demo --plot``: the loss and the memory per step, and the throughput per epoch."""

from __future__ import annotations

import importlib
from typing import Any

from .summary import DemoSummary

__all__ = ["plot_summary"]


def plot_summary(summary: DemoSummary, path: str) -> None:
    # The object-oriented API with no pyplot: no display needed, and the caller's
    # matplotlib backend and global state are left alone.
    # (Imported by name so that type checking works without the optional extra.)
    figure_cls = importlib.import_module("matplotlib.figure").Figure

    fig = figure_cls(figsize=(8, 6))
    ax_loss, ax_mem, ax_speed = fig.subplots(3, 1, height_ratios=(2, 2, 1.4))
    ax_mem.sharex(ax_loss)
    steps = range(1, len(summary.step_losses) + 1)
    ax_loss.plot(steps, summary.step_losses, linewidth=1)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(f"cudakit demo on {summary.device} ({summary.dtype})")
    kind = "RSS" if summary.device.startswith("cpu") else "allocated"
    ax_mem.plot(steps, [m / 2**20 for m in summary.step_memory], linewidth=1, color="tab:orange")
    ax_mem.set_ylabel(f"memory {kind} (MiB)")
    ax_mem.set_xlabel("micro-step")
    _plot_speed(ax_speed, summary)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_speed(ax: Any, summary: DemoSummary) -> None:
    """Samples/s per epoch (bars), and the achieved TFLOP/s where measured (a line)."""
    epochs = [e.epoch for e in summary.epochs]
    ax.bar(epochs, [e.samples_per_s for e in summary.epochs], color="tab:green", width=0.6)
    ax.set_ylabel("samples/s")
    ax.set_xlabel("epoch")
    ax.set_xticks(epochs)
    measured = [(e.epoch, e.tflops) for e in summary.epochs if e.tflops is not None]
    if measured:
        twin = ax.twinx()
        twin.plot(*zip(*measured, strict=True), marker="o", color="tab:purple")
        twin.set_ylabel("TFLOP/s")
        twin.set_ylim(bottom=0)
