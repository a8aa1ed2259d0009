"""Draw the documentation's figures from the data files beside them in ``docs/figures/``.

    python scripts/make_figures.py                # every PNG in docs/figures/, from its data
    python scripts/make_figures.py --out DIR      # write the PNGs to DIR instead
    python scripts/make_figures.py --tables       # also rewrite the tables of benchmarks.md
    python scripts/make_figures.py --rerun-demo   # first run `cudakit demo` here and
                                                  # replace docs/figures/demo.json with it

One data file per figure:

================================  ================================  ==========================
data                              figure                            what it shows
================================  ================================  ==========================
demo.json                         demo.png                          what ``cudakit demo
                                                                    --plot`` draws: loss and
                                                                    memory per step,
                                                                    throughput per epoch
prefetch_timeline.csv             prefetch_timeline.png             copy/compute overlap
                                                                    (a schematic)
bench_on_device.json              bench_on_device.png               ratios to the
                                                                    hand-written code
bench_autocast_step.json          bench_autocast_step.png           ratios to the
                                                                    hand-written code
bench_autocast_step_compile.json  bench_autocast_step_compile.png   the same, eager and
                                                                    compiled
bench_loss_spikes.json            bench_loss_spikes.png             the step with
                                                                    ``skip_spikes`` over
                                                                    the step without
bench_memory_report.json          bench_memory_report.png           time per report
bench_warmup.json                 bench_warmup.png                  pass times with and
                                                                    without warmup
bench_prefetch.json               bench_prefetch.png                time per batch with and
                                                                    without it
bench_checkpoint.json             bench_checkpoint.png              save and load time; the
                                                                    time blocked
bench_speed_report.json           bench_speed_report.png            what the meter adds to
                                                                    a step
bench_watching.json               bench_watching.png                a watched run over the
                                                                    hand-written loop
bench_recompute.json              bench_recompute.png               step time and peak per
                                                                    recompute policy
bench_estimate.json               bench_estimate.png                estimated peak /
                                                                    measured peak per cell
================================  ================================  ==========================

Each ``bench_*.json`` is what its script writes with ``--json`` (``benchmarks/_report.py``):
the figures of one run, the machine (CPU model, cores, torch, Python, the peers' versions)
and the date. To refresh a benchmark, run it with ``--json docs/figures/NAME.json``, then
this script with ``--tables`` (or ``scripts/bench_tables.py``): the chart and the table on
docs/benchmarks.md both come from that file, with nothing edited by hand. A ratio chart
(``reference`` in the data) has bars from 1; any other, bars from 0.

``--rerun-demo`` runs the demo on this machine. Its timings and memory are this
machine's, and on another CPU even its losses differ with the same seed and torch build
(most likely other kernels, which round differently): on 2026-12-04 a rerun on an AMD
EPYC VM ended its last epoch at a training loss of 1.2078 where the saved run, made on
another CPU with the same torch 2.13.0+cpu, had 1.2063. So the redrawn ``demo.png`` is
this machine's, not the one in the docs.

Needs matplotlib (the ``plot`` extra). Only matplotlib's object-oriented ``Figure`` API is
used (no pyplot), so no display is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import platform
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"
#: Same PNG bytes for the same data: no timestamp or version in the metadata.
_PNG_METADATA: dict[str, Any] = {"Software": None}
_DPI = 100
_GREEN = ("#2e7d32", "#66bb6a", "#a5d6a7")  # cudakit's variants; the site's primary is green
_PEERS = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tables import describe  # noqa: E402  (the machine in words, as on the page)


def _figure(**kwargs: Any) -> Any:
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI, metadata=_PNG_METADATA)
    return path


# -- cudakit demo ----------------------------------------------------------------------


def rerun_demo(data: Path) -> None:
    """Run ``cudakit demo --plot`` here (defaults, seed 0) and save its data to ``data``.

    The run is this machine's: another CPU gives other timings and memory, and other
    losses for the same seed and torch build (most likely its kernels round differently).

    ``--json`` leaves out the per-step series the plot is drawn from, so the summary
    is taken from the demo's own plot function as it is called.
    """
    import cudakit.demo.command as demo

    captured: list[Any] = []
    plot = demo.plot_summary

    def capture(summary: Any, path: str) -> None:
        captured.append(summary)
        plot(summary, path)

    demo.plot_summary = capture
    load_before = os.getloadavg()[0]
    out = io.StringIO()
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
            status = demo.main(["--no-progress", "--json", "--plot", str(Path(tmp) / "d.png")])
    finally:
        demo.plot_summary = plot
    if status != 0 or not captured:
        raise SystemExit(f"cudakit demo failed (exit {status}):\n{out.getvalue()}")
    summary = captured[0]
    import torch

    record = {
        "command": "cudakit demo --plot demo.png (defaults, --seed 0)",
        "measured": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}, "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        # The timings in the summary are only as good as the machine was quiet.
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "summary": summary.to_dict(),
        "step_losses": [round(x, 6) for x in summary.step_losses],
        "step_memory": list(summary.step_memory),
    }
    data.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def demo_figure(data: Path, out: Path) -> Path:
    """Draw ``demo.png`` with the demo's own plot function, from the saved run."""
    from cudakit.demo import DemoSummary, EpochStats

    record = json.loads(data.read_text(encoding="utf-8"))
    fields = dict(record["summary"])
    for derived in ("loss_fell", "steps_skipped"):
        fields.pop(derived, None)
    fields["epochs"] = [EpochStats(**e) for e in fields["epochs"]]
    summary = DemoSummary(
        **fields, step_losses=record["step_losses"], step_memory=record["step_memory"]
    )
    from cudakit.demo._plot import plot_summary

    path = out / "demo.png"
    plot_summary(summary, str(path))
    return path


# -- prefetch timeline -----------------------------------------------------------------


def timeline_figure(data: Path, out: Path) -> Path:
    """Draw the copy/compute timeline with and without ``prefetch`` (a schematic)."""
    with data.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    lanes: list[tuple[str, str]] = []
    for r in rows:
        if (r["loop"], r["stream"]) not in lanes:
            lanes.append((r["loop"], r["stream"]))
    fig = _figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.subplots()
    end = max(float(r["end"]) for r in rows)
    for r in rows:
        y = len(lanes) - 1 - lanes.index((r["loop"], r["stream"]))
        start, stop = float(r["start"]), float(r["end"])
        copy = r["label"].startswith("copy")
        ax.barh(
            y,
            stop - start,
            left=start,
            height=0.6,
            color="#90caf9" if copy else _GREEN[1],
            edgecolor="black",
            linewidth=0.6,
        )
        ax.text((start + stop) / 2, y, r["label"], ha="center", va="center", fontsize=9)
    for loop in dict.fromkeys(lp for lp, _ in lanes):
        last = max((r for r in rows if r["loop"] == loop), key=lambda r: float(r["end"]))
        y = len(lanes) - 1 - lanes.index((loop, last["stream"]))
        ax.text(float(last["end"]) + 0.1, y, f"done at {float(last['end']):g}", va="center")
    ax.set_yticks(
        [len(lanes) - 1 - i for i in range(len(lanes))],
        [f"{loop}\n{stream}" for loop, stream in lanes],
        fontsize=9,
    )
    boundary = sum(1 for lp, _ in lanes if lp == lanes[0][0])
    ax.axhline(len(lanes) - boundary - 0.5, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, end * 1.15)
    ax.set_xticks([])
    ax.set_xlabel("time  (schematic: copy 1 unit, step 1.2 units; not a measurement)")
    ax.set_title("prefetch: the next batches are copied on a side stream while a step computes")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return _save(fig, out / "prefetch_timeline.png")


# -- benchmark ratios ------------------------------------------------------------------


def ratio_figure(data: Path, out: Path) -> Path:
    """Bars from 1 (the hand-written reference) to each implementation's ratio, per case.

    With one case only, each implementation is a line of its own, named on the axis.
    """
    record = json.loads(data.read_text(encoding="utf-8"))
    rows = [r for r in record["rows"] if r["implementation"] != record["reference"]]
    keys = record["group_by"]
    groups = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    single = len(groups) == 1
    if single:  # one case: the implementations are the lines
        keys = ["implementation"]
        groups = [(i,) for i in impls]
    ours = [i for i in impls if i.startswith("cudakit")]
    colors = dict(zip(ours, _GREEN, strict=False))
    colors.update(zip([i for i in impls if i not in ours], _PEERS, strict=False))
    n = 1 if single else len(impls)
    height = 0.8 / n
    fig = _figure(figsize=(9, 1.0 + 0.19 * n * len(groups) + 0.25 * len(groups)))
    ax = fig.subplots()
    ratios = [r["ratio"] for r in rows]
    lo, hi = min(*ratios, 1.0), max(*ratios, 1.0)
    log = hi / lo > 3
    labelled: set[str] = set()  # each implementation named once, where first drawn
    for g, group in enumerate(groups):
        for k, impl in enumerate([group[0]] if single else impls):
            found = [
                r
                for r in rows
                if tuple(r[x] for x in keys) == group and r["implementation"] == impl
            ]
            if not found:  # an implementation measured for some cases only
                continue
            (r,) = found
            y = g + (k - (n - 1) / 2) * height
            ratio = r["ratio"]
            ax.barh(
                y,
                ratio - 1,
                left=1,
                height=height * 0.9,
                color=colors[impl],
                label=impl if impl not in labelled and n > 1 else None,
            )
            labelled.add(impl)
            ax.text(
                ratio,
                y,
                f" {ratio:.2f}x " if log else f" {ratio:.3f} ",
                va="center",
                ha="left" if ratio >= 1 else "right",
                fontsize=8,
            )
    ax.axvline(1, color="black", linewidth=1)
    ax.set_yticks(range(len(groups)), [", ".join(group) for group in groups], fontsize=9)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
        ax.set_xlim(lo / 1.6, hi * 1.6)
        ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20) if lo / 1.6 <= t <= hi * 1.6]
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    else:
        span = hi - lo
        ax.set_xlim(lo - 0.25 * span, hi + 0.2 * span)
    ax.set_xlabel(f"time / {record['reference']} time  (left of 1: faster, right: slower)")
    ax.set_title(textwrap.fill(record["title"], 80), fontsize=11)
    if n > 1:
        ax.legend(loc="lower right", fontsize=8, frameon=False)
    return _finish(fig, record, out / f"{data.stem}.png")


def _finish(fig: Any, record: dict[str, Any], path: Path) -> Path:
    """Sign the figure with where and how it was measured, then save it."""
    settings = f"; {record['settings']}" if record.get("settings") else ""
    fig.text(
        0.01,
        0.005,
        f"{record['script']}, measured {record['measured']}: "
        f"{describe(record['machine'])}{settings}",
        fontsize=7,
        color="dimgray",
        wrap=True,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _save(fig, path)


def bars_figure(data: Path, out: Path) -> Path:
    """Horizontal bars of measured values (one bar per series in each group), from 0."""
    record = json.loads(data.read_text(encoding="utf-8"))
    rows = record["rows"]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    series = list(dict.fromkeys(r["series"] for r in rows))
    palette = ("#90caf9", _GREEN[0], "#ffcc80", "#ce93d8", "#b0bec5", "#ef9a9a")
    colors = dict(zip(series, palette if len(series) > 1 else (_GREEN[0],), strict=False))
    n = len(series)
    per_group = max(len({r["series"] for r in rows if r["group"] == g}) for g in groups)
    fig = _figure(figsize=(9, 1.3 + 0.3 * per_group * len(groups) + 0.1 * len(groups)))
    ax = fig.subplots()
    top = max(r["value"] for r in rows)
    low = min(0, *(r["value"] for r in rows))  # a bar can go below 0 (a share saved)
    labelled: set[str] = set()
    for g, group in enumerate(groups):
        # The series this group has (a group may lack some), spread over its row.
        present = [s for s in series if any(r["group"] == group and r["series"] == s for r in rows)]
        height = 0.8 / len(present)
        for k, name in enumerate(present):
            (value,) = [r["value"] for r in rows if r["group"] == group and r["series"] == name]
            y = g + (k - (len(present) - 1) / 2) * height
            label = name if n > 1 and name not in labelled else None
            labelled.add(name)
            ax.barh(y, value, height=height * 0.9, color=colors[name], label=label)
            ax.text(
                value,
                y,
                f" {value} ",
                va="center",
                ha="left" if value >= 0 else "right",
                fontsize=8,
            )
    goal = record.get("goal")
    if goal:
        ax.axvline(goal["value"], color="firebrick", linestyle="--", linewidth=1)
        ax.text(goal["value"], -0.6, f"{goal['label']} ", color="firebrick", fontsize=8, ha="right")
        top = max(top, goal["value"])
    ax.set_yticks(range(len(groups)), groups, fontsize=9)
    ax.set_ylim(len(groups) - 0.5, -0.8)
    if low < 0:
        ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlim(low - 0.15 * (top - low) if low < 0 else 0, top * 1.15)
    ax.set_xlabel(record["unit"])
    ax.set_title(textwrap.fill(record["title"], 80), fontsize=11)
    if n > 1:
        ax.legend(loc="best", fontsize=8, frameon=False)
    return _finish(fig, record, out / f"{data.stem}.png")


# -- main ------------------------------------------------------------------------------


def draw(data: Path, out: Path) -> Path:
    """Draw one benchmark's chart from its data file into ``out``; return the PNG."""
    record = json.loads(data.read_text(encoding="utf-8"))
    return (ratio_figure if "reference" in record else bars_figure)(data, out)


def make_all(out: Path, figures: Path = FIGURES) -> list[Path]:
    """Draw every figure from the data in ``figures`` into ``out``; return the PNGs."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        demo_figure(figures / "demo.json", out),
        timeline_figure(figures / "prefetch_timeline.csv", out),
        *(draw(data, out) for data in sorted(figures.glob("bench_*.json"))),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=FIGURES, help="folder for the PNGs")
    p.add_argument(
        "--rerun-demo",
        action="store_true",
        help="run `cudakit demo` on this machine first and replace docs/figures/demo.json "
        "with its data (this machine's numbers: another CPU gives others)",
    )
    p.add_argument(
        "--tables",
        action="store_true",
        help="also rewrite the tables of docs/benchmarks.md from the data (bench_tables.py)",
    )
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("needs matplotlib: pip install -e '.[plot]'")
    if args.rerun_demo:
        rerun_demo(FIGURES / "demo.json")
    for path in make_all(args.out):
        print(path)
    if args.tables:
        import bench_tables

        return bench_tables.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
