"""``cudakit demo --plot``: the loss and the memory per step, as a PNG."""

from __future__ import annotations

import importlib

from .summary import DemoSummary

__all__ = ["plot_summary"]


def plot_summary(summary: DemoSummary, path: str) -> None:
    # The object-oriented API with no pyplot: no display needed, and the caller's
    # matplotlib backend and global state are left alone.
    # (Imported by name so that type checking works without the optional extra.)
    figure_cls = importlib.import_module("matplotlib.figure").Figure

    fig = figure_cls(figsize=(8, 6))
    ax_loss, ax_mem = fig.subplots(2, 1, sharex=True)
    steps = range(1, len(summary.step_losses) + 1)
    ax_loss.plot(steps, summary.step_losses, linewidth=1)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(f"cudakit demo on {summary.device} ({summary.dtype})")
    kind = "RSS" if summary.device.startswith("cpu") else "allocated"
    ax_mem.plot(steps, [m / 2**20 for m in summary.step_memory], linewidth=1, color="tab:orange")
    ax_mem.set_ylabel(f"memory {kind} (MiB)")
    ax_mem.set_xlabel("micro-step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
