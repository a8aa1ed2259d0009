"""Write each benchmark's table on docs/benchmarks.md from its data file in docs/figures/.

    python scripts/bench_tables.py            # rewrite every table between its markers
    python scripts/bench_tables.py --check    # only say which tables differ (exit 1)

A benchmark run with ``--json docs/figures/NAME.json`` writes its figures, the machine
and the date (``benchmarks/_report.py``). The page holds each table between two comments
named after that file::

    <!-- bench_on_device:table -->
    (generated: the date, the machine and the command, then the table)
    <!-- /bench_on_device:table -->

and this script writes what goes between them from the file alone, as
``scripts/make_figures.py`` draws the chart from it; nothing in a table is typed by hand.
Needs nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
PAGE = ROOT / "docs" / "benchmarks.md"

Record = dict[str, Any]


def load(path: Path) -> Record:
    """A benchmark's data file."""
    data: Record = json.loads(path.read_text(encoding="utf-8"))
    return data


def describe(machine: dict[str, Any] | str) -> str:
    """The machine in words: CPU model, cores, system, torch, Python, and the peers."""
    if isinstance(machine, str):
        return machine
    text = (
        f"{machine['cpu']}, {machine['cores']} cores, {machine['system']}, "
        f"torch {machine['torch']}, Python {machine['python']}"
    )
    peers = ", ".join(f"{name} {version}" for name, version in machine["peers"].items())
    return f"{text} ({peers})" if peers else text


#: How ``benchmarks/_report.py`` marks a run whose ``cudakit/`` differed from its commit.
_UNCOMMITTED = ", with uncommitted changes in cudakit/"


def commit(revision: str) -> str:
    """The commit a run measured, in one clause: ``commit abc1234``, and where ``cudakit/``
    had changes not yet committed, that fact in a few words (no later commit is guessed)."""
    if revision.endswith(_UNCOMMITTED):
        return f"commit {revision.removesuffix(_UNCOMMITTED)} plus uncommitted cudakit/ changes"
    return f"commit {revision}"


def measured_line(record: Record) -> str:
    """The line above a table: when, on what, with which command and settings."""
    line = f"Measured {record['measured']} on {describe(record['machine'])}"
    if record.get("revision"):
        line += f", {commit(record['revision'])}"
    if record.get("load_average"):
        before, after = record["load_average"]
        line += f", load average {before} to {after}"
    return f"{line}; `{record['command']}`: {record['settings']}."


def _table(header: Sequence[str], align: str, rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    rule = "|".join("---:" if a == "r" else "---" for a in align)
    return [f"| {' | '.join(header)} |", f"|{rule}|", *(f"| {' | '.join(r)} |" for r in rows)]


def _columns(record: Record, keys: Sequence[str]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The groups (by ``keys``) and the implementations of a ratio record, in order."""
    rows = record["rows"]
    groups = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    impls = list(dict.fromkeys(r["implementation"] for r in rows))
    return groups, impls


def _cell(record: Record, group: tuple[str, ...], keys: Sequence[str], impl: str) -> Record:
    (row,) = [
        r
        for r in record["rows"]
        if tuple(r[k] for k in keys) == group and r["implementation"] == impl
    ]
    return row


def on_device_table(record: Record) -> list[str]:
    """Cases down, implementations across: the reference's time, then ratios to it."""
    keys = record["group_by"]
    groups, impls = _columns(record, keys)
    reference = record["reference"]
    body = []
    for group in groups:
        cells = list(group)
        for impl in impls:
            row = _cell(record, group, keys, impl)
            cells.append(
                f"{row['time_us']:,.1f} µs" if impl == reference else f"{row['ratio']:.2f}x"
            )
        body.append(cells)
    header = ["from, to", "case", *impls]
    return _table(header, "l" * len(keys) + "r" * len(impls), body)


def ratio_table(record: Record) -> list[str]:
    """Implementations down, cases across: the reference's time, then ratios to it.

    Narrow whatever the number of implementations (peers come and go with what is
    installed); the runs' own comparisons (``pairs``) follow as a list.
    """
    keys = record["group_by"]
    groups, impls = _columns(record, keys)
    reference = record["reference"]
    body = []
    for impl in impls:
        cells = [impl]
        for group in groups:
            row = _cell(record, group, keys, impl)
            cells.append(
                f"{row['time_us']:,.0f} µs" if impl == reference else f"{row['ratio']:.3f}"
            )
        body.append(cells)
    header = ["implementation", *(", ".join(g) for g in groups)]
    lines = _table(header, "l" + "r" * len(groups), body)
    pairs = record.get("pairs") or []
    if pairs:
        lines.append("")
        for pair in pairs:
            where = f" ({pair['case']})" if len(groups) > 1 else ""
            lines.append(f"- {pair['mine']} / {pair['theirs']}{where}: {pair['ratio']:.3f}")
    return lines


def loss_spikes_table(record: Record) -> list[str]:
    """One line per variant: the step without the rule, with it, and the ratio; and the
    rule's cost in place (its added host time per window, and that as a share of the
    step without it) where the data has it."""
    rows = record["rows"]
    placed = all("in_place_us" in r for r in rows)
    body = [
        [
            r["path"],
            r["clipping"],
            r["skip_spikes"],
            f"{r['without_us']:,.1f} µs",
            f"{r['time_us']:,.1f} µs",
            f"{r['ratio']:.3f}",
            *(
                [f"{r['in_place_us']:.1f} µs ({100 * r['in_place_us'] / r['without_us']:.1f} %)"]
                if placed
                else []
            ),
        ]
        for r in rows
    ]
    header = ["path", "clipping", "skip_spikes", "without", "with", "ratio"]
    if placed:
        header.append("in place")
    return _table(header, "lllrrr" + "r" * placed, body)


def memory_report_table(record: Record) -> list[str]:
    """One line per variant: microseconds per call, and the multiple of a tiny op."""
    body = [[r["group"], f"{r['value']:.2f}", f"{r['x_add']:.1f}"] for r in record["rows"]]
    return _table(["variant", "µs / call", "x `torch.add`"], "lrr", body)


def warmup_table(record: Record) -> list[str]:
    """The measures as the script printed them."""
    body = [[r["measure"], r["value"]] for r in record["table"]]
    return _table(["measure", "value"], "lr", body)


def prefetch_table(record: Record) -> list[str]:
    """Per source and batch size: plain and prefetched µs per batch, and the overhead."""
    if "table" not in record:  # the GPU mode: its chart rows
        return bars_table(record)
    body = [
        [
            r["source"],
            str(r["batch"]),
            f"{r['plain_us']:.1f}",
            f"{r['prefetch_us']:.1f}",
            f"{r['extra_us']:.2f}",
            "n/a" if r["overhead_pct"] is None else f"{r['overhead_pct']:+.1f}%",
        ]
        for r in record["table"]
    ]
    header = ["source", "batch", "plain µs", "prefetch µs", "extra µs", "overhead"]
    return _table(header, "lrrrrr", body)


def speed_report_table(record: Record) -> list[str]:
    """What is measured down, precisions across, with each precision's step time: the
    share of the step in percent (side by side: added; the meter alone: its cost), then
    the meter's own microseconds per call and the host reads."""
    rows = record["rows"]
    steps = {s["series"]: s for s in record["steps"]}
    series = list(dict.fromkeys(r["series"] for r in rows))
    groups = list(dict.fromkeys(r["group"] for r in rows))
    value = {(r["group"], r["series"]): r["value"] for r in rows}
    body = [[f"{group}, %", *(f"{value[group, s]:.2f}" for s in series)] for group in groups]
    for form in steps[series[0]]["meter_us"]:
        label = f"the meter alone: {form}, µs per call"
        body.append([label, *(f"{steps[s]['meter_us'][form]:.2f}" for s in series)])
    for form in steps[series[0]].get("in_place_us", {}):
        label = f"the meter in place: {form}, µs per call"
        cells = (steps[s].get("in_place_us", {}).get(form) for s in series)
        body.append([label, *("" if v is None else f"{v:.2f}" for v in cells)])
    body.append(
        [
            f"host reads in {steps[series[0]]['metered_steps']} metered steps",
            *(str(steps[s]["host_reads"]) for s in series),
        ]
    )
    header = ["what is measured", *(f"{s} (step {steps[s]['step_us']:,.0f} µs)" for s in series)]
    return _table(header, "l" + "r" * len(series), body)


_CHECKPOINT_NAMES = {
    "torch.save": "`torch.save` / `torch.load`",
    "Checkpointer": "`Checkpointer.save()` / `resume()`",
    "Checkpointer async": "`Checkpointer(async_save=True)`, until written",
    "async: loop blocked": "`async_save=True`: the loop blocked",
    "accelerate save_state": "accelerate `save_state` / `load_state`",
}


def checkpoint_table(record: Record) -> list[str]:
    """Per implementation: save and load seconds, and their ratios to torch's."""
    value = {(r["group"], r["series"]): r["value"] for r in record["rows"]}
    base = {s: value["torch.save", s] for s in ("save", "load")}
    body = []
    for group in dict.fromkeys(r["group"] for r in record["rows"]):
        cells = [_CHECKPOINT_NAMES.get(group, group)]
        for series in ("save", "load"):
            v = value.get((group, series))
            cells += ["", ""] if v is None else [f"{v:.2f}", f"{v / base[series]:.2f}"]
        body.append(cells)
    header = ["implementation", "save s", "x `torch.save`", "load s", "x `torch.load`"]
    lines = _table(header, "lrrrr", body)
    peer = "accelerate save_state"
    if (peer, "save") in value:
        ratio = {s: value["Checkpointer", s] / value[peer, s] for s in ("save", "load")}
        lines += [
            "",
            f"- `Checkpointer` / accelerate: save {ratio['save']:.2f}, load {ratio['load']:.2f}",
        ]
    restart = record.get("restart")
    if restart:
        line = "- a restarted run's resume (a new model and optimizer), s: " + ", ".join(
            f"{name} {value:.2f}" for name, value in restart.items()
        )
        if "accelerate load_state" in restart:
            mine = restart["Checkpointer"] / restart["accelerate load_state"]
            line += f"; `Checkpointer` / accelerate {mine:.2f}"
        lines += [line]
    small = record.get("small")
    if small:
        saves, loops = small["save"], small["loop"]
        lines += ["", f"Small model ({small['params'] / 1e3:.0f}k parameters + AdamW state):", ""]
        lines += [
            "- one save, x `torch.save`: "
            + ", ".join(
                f"{name} {value / saves['torch.save']:.2f}"
                for name, value in saves.items()
                if name != "torch.save"
            )
            + f" (`torch.save` {saves['torch.save'] * 1e3:.1f} ms)",
            "- 60 steps saving every 5, x the hand-written loop: "
            + ", ".join(
                f"{name} {value / loops['hand-written']:.3f}"
                for name, value in loops.items()
                if name != "hand-written"
            ),
        ]
    ranks = record.get("fsdp") or []
    timed = ranks[0].get("times") if ranks else None
    if timed:
        mine, theirs = timed["Checkpointer"], timed["DCP by hand"]
        lines += [
            "",
            f"- FSDP2, 2 gloo ranks, `Checkpointer` / DCP by hand: save "
            f"{mine['save'] / theirs['save']:.2f}, load {mine['load'] / theirs['load']:.2f}",
        ]
    return lines


def meta_init_table(record: Record) -> list[str]:
    """Per world size and phase: peak memory per rank against shard + largest tensor,
    time (setup: against building the model on every rank) and bytes read."""
    body = []
    for r in record["rows"]:
        ratio = f"{r['time_ratio']:.2f}" if r["time_ratio"] is not None else ""
        read = f"{r['read_mib']:,.1f}" if r["read_mib"] is not None else ""
        body.append(
            [
                str(r["ranks"]),
                r["phase"],
                r["series"],
                f"{r['value']:,.1f}",
                f"{r['over_goal']:.2f}",
                f"{r['seconds']:.2f}",
                ratio,
                read,
                f"{r['shard_mib']:,.1f}",
            ]
        )
    header = [
        "ranks",
        "phase",
        "implementation",
        "peak MiB",
        "x (shard + largest)",
        "time s",
        "x build, then shard",
        "read MiB",
        "shard MiB",
    ]
    return _table(header, "lll" + "r" * 6, body)


def recompute_table(record: Record) -> list[str]:
    """Per policy and implementation: step time, peak, each x no recompute; the estimate."""
    body = [
        [
            r["policy"],
            r["implementation"],
            f"{r['step_ms']:.1f}",
            f"{r['time_ratio']:.2f}",
            f"{r['peak_mib']:.1f}",
            f"{r['peak_ratio']:.2f}",
            f"{r['estimate_ratio']:.3f}",
        ]
        for r in record["table"]
    ]
    header = ["policy", "implementation", "ms / step", "x time", "peak MiB", "x peak"]
    lines = _table([*header, "estimate / measured"], "llrrrrr", body)
    paired = record.get("paired")  # cudakit / by hand, timed side by side in each round
    if paired:
        said = "; ".join(f"{name} {ratio:.3f}" for name, ratio in paired.items())
        lines += ["", f"- cudakit / `checkpoint_wrapper` by hand, median of each round: {said}"]
    return lines


def estimate_table(record: Record) -> list[str]:
    """Per cell: the measured peak (the largest over the ranks), then each estimate of it as
    a ratio (accelerate's where the run had it); and how many cells are within tolerance."""
    rows = record["table"]
    peers = [
        (name, key)
        for name, key in (("accelerate", "accelerate_ratio"), ("DeepSpeed", "deepspeed_ratio"))
        if any(r.get(key) is not None for r in rows)
    ]
    body = [
        [
            str(r["world"]),
            r["strategy"],
            r["recompute"],
            r["precision"],
            f"{r['measured_kib']:,.1f}",
            f"{r['ratio']:.3f}",
            *(f"{r[key]:.3f}" for _, key in peers),
        ]
        for r in rows
    ]
    header = ["ranks", "strategy", "recompute", "precision", "measured KiB", "cudakit"]
    header += [name for name, _ in peers]
    lines = _table(header, "llllrr" + "r" * len(peers), body)
    tolerance = record["tolerance"]
    within = sum(abs(r["ratio"] - 1) <= tolerance for r in rows)
    worst = max(abs(r["ratio"] - 1) for r in rows)
    return [
        *lines,
        "",
        f"- `estimate_memory` within {tolerance * 100:.0f} % in {within} of {len(rows)} "
        f"cells; furthest {worst * 100:.1f} % off",
    ]


def bars_table(record: Record) -> list[str]:
    """Any bar chart's rows: group, series, value."""
    body = [[r["group"], r["series"], f"{r['value']:g}"] for r in record["rows"]]
    return _table(["measure", "series", record["unit"]], "llr", body)


#: The table of each data file, by its name (docs/figures/NAME.json).
TABLES: dict[str, Callable[[Record], list[str]]] = {
    "bench_on_device": on_device_table,
    "bench_autocast_step": ratio_table,
    "bench_autocast_step_compile": ratio_table,
    "bench_loss_spikes": loss_spikes_table,
    "bench_memory_report": memory_report_table,
    "bench_warmup": warmup_table,
    "bench_prefetch": prefetch_table,
    "bench_speed_report": speed_report_table,
    "bench_checkpoint": checkpoint_table,
    "bench_meta_init": meta_init_table,
    "bench_watching": ratio_table,
    "bench_recompute": recompute_table,
    "bench_estimate": estimate_table,
}


def render(name: str, record: Record) -> str:
    """What goes between the markers of ``name``: the measured line, then the table (a
    blank line on either side, so that Markdown never reads a marker as a table row)."""
    return "\n".join(["", measured_line(record), "", *TABLES[name](record), "", ""])


def _markers(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- {re.escape(name)}:table -->\n)(.*?)(<!-- /{re.escape(name)}:table -->)",
        re.S,
    )


def update(page: str, figures: Path = FIGURES) -> tuple[str, list[str]]:
    """``page`` with every table rewritten from ``figures``; and the names that changed.

    Raises:
        ValueError: a data file whose markers are not on the page exactly once.
    """
    changed = []
    for name in TABLES:
        pattern = _markers(name)
        found = pattern.findall(page)
        if len(found) != 1:
            raise ValueError(
                f"docs/benchmarks.md has {len(found)} blocks for {name}; put its table "
                f"between <!-- {name}:table --> and <!-- /{name}:table --> once"
            )
        new = render(name, load(figures / f"{name}.json"))
        if found[0][1] != new:
            changed.append(name)
            page = pattern.sub(lambda m, new=new: m[1] + new + m[3], page)
    return page, changed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--figures", type=Path, default=FIGURES, help="folder of the data files")
    args = p.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    new, changed = update(text, args.figures)
    for name in changed:
        print(f"{name}: {'differs from its data' if args.check else 'rewritten'}")
    if args.check:
        return 1 if changed else 0
    if changed:
        args.page.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
