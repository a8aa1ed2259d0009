"""Overhead of entering and leaving a ``memory_report`` (goal: < 20 µs on CPU).

Run ``python benchmarks/bench_memory_report.py`` (``--quick`` for a smoke run,
``--device cuda`` on a GPU machine). One process; the variants run in
interleaved rounds so machine noise hits all of them alike; the table shows the
median per-call cost over rounds, minus an empty loop, and the median ratio to
the cost of a tiny torch op (``torch.add`` on a 1-element tensor) for scale.

The clock is the benchmarking thread's CPU time by default (``--clock cpu``): the
calls never wait, so on an idle machine it equals the wall time, and on a shared
one other processes do not inflate it. ``--clock wall`` measures wall time.

No peer library offers a per-block memory report (accelerate, Lightning Fabric
and Ignite expose the raw ``torch.cuda`` counters), so the comparison is with
the hand-written ``torch.cuda`` equivalent on CUDA, and with a bare /proc read
on the CPU.

``--json PATH`` also writes the figures, the machine and the date as the data file of
``docs/figures/bench_memory_report.json`` (chart: ``scripts/make_figures.py``; table of
docs/benchmarks.md: ``scripts/bench_tables.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report

from cudakit.memory import memory_report, memory_snapshot

#: The variant every verdict is about: a fresh report entered and left.
FRESH = "with memory_report(device={device!r}, file=None)"
EMPTY = "empty loop (subtracted)"
SCALE = "torch.add(1-elem), for scale"


def _variants(device: str) -> dict[str, Callable[[int], None]]:
    reused = memory_report(device=device, file=None)

    @memory_report(device=device, file=None)
    def decorated() -> None:
        pass

    x = torch.ones(1, device=device)

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    def tiny_op(n: int) -> None:
        for _ in range(n):
            torch.add(x, 1)

    def fresh(n: int) -> None:
        for _ in range(n):
            with memory_report(device=device, file=None):
                pass

    def fresh_default_device(n: int) -> None:
        for _ in range(n):
            with memory_report(file=None):
                pass

    def reuse(n: int) -> None:
        for _ in range(n):
            with reused:
                pass

    def decorator(n: int) -> None:
        for _ in range(n):
            decorated()

    def snapshot(n: int) -> None:
        for _ in range(n):
            memory_snapshot(device)

    out = {
        EMPTY: empty,
        SCALE: tiny_op,
        FRESH.format(device=device).replace("'", '"'): fresh,
        "with memory_report(file=None)": fresh_default_device,
        "reused reporter: with rep:": reuse,
        "@memory_report decorated call": decorator,
        f'memory_snapshot("{device}")': snapshot,
    }
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0

        def hand_written(n: int) -> None:
            for _ in range(n):
                torch.cuda.memory_allocated(idx)
                torch.cuda.reset_peak_memory_stats(idx)
                torch.cuda.max_memory_allocated(idx)
                torch.cuda.memory_allocated(idx)

        out["hand-written torch.cuda reads"] = hand_written
    else:
        fd = os.open("/proc/self/status", os.O_RDONLY) if os.path.exists("/proc") else -1

        def proc_read(n: int) -> None:
            for _ in range(n):
                if fd >= 0:
                    os.pread(fd, 8192, 0)

        out["one bare /proc/self/status read"] = proc_read
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None, help="calls per variant per round")
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="thread CPU time or wall time"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the data file")
    args = parser.parse_args(argv)
    load = _report.load_average()
    rounds = args.rounds or (3 if args.quick else 15)
    calls = args.calls or (500 if args.quick else 5000)
    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            sys.exit("--device cuda needs a CUDA GPU; this machine has none")
        torch.ones(1, device=device)  # start CUDA so the report measures it

    variants = _variants(device)
    for fn in variants.values():  # warm up
        fn(max(10, calls // 10))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = clock()
            fn(calls)
            times[name].append((clock() - t0) / calls)
    base = times[EMPTY]
    scale = [t - b for t, b in zip(times[SCALE], base, strict=True)]

    print(
        f"memory_report overhead on {device}: torch {torch.__version__}, Python "
        f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; "
        f"{rounds} interleaved rounds x {calls} calls; median {args.clock} time per call"
    )
    w = max(len(name) for name in times)
    print(f"| {'variant':<{w}} | {'µs / call':>10} | {'x torch.add':>11} |")
    print(f"|{'-' * (w + 2)}|{'-' * 11}:|{'-' * 12}:|")
    rows: list[dict[str, Any]] = []
    for name, ts in times.items():
        if name == EMPTY:
            continue
        net = [t - b for t, b in zip(ts, base, strict=True)]
        med = statistics.median(net) * 1e6
        ratio = statistics.median(n / s for n, s in zip(net, scale, strict=True))
        print(f"| {name:<{w}} | {med:>10.2f} | {ratio:>11.1f} |")
        rows.append({"group": name, "series": "median", "value": round(med, 2), "x_add": ratio})
    fresh_name = FRESH.format(device=device).replace("'", '"')
    fresh = statistics.median(t - b for t, b in zip(times[fresh_name], base, strict=True))
    goal = 20e-6
    verdict = "meets" if fresh < goal else "MISSES"
    print(f"\nenter+exit of a fresh report: {fresh * 1e6:.1f} µs ({verdict} the < 20 µs goal)")
    if args.json:
        settings = (
            f"device {device}, {rounds} interleaved rounds x {calls} calls, median "
            f"{'thread CPU' if args.clock == 'cpu' else 'wall'} time per call, an empty loop "
            "subtracted"
        )
        _report.write(args.json, figure_data(rows, settings, argv, load))


def figure_data(
    rows: list[dict[str, Any]], settings: str, argv: list[str] | None, load: float
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_memory_report.json."""
    return _report.record(
        "benchmarks/bench_memory_report.py",
        title="memory_report: cost of entering and leaving a report",
        settings=settings,
        argv=argv,
        load_before=load,
        unit="µs per call",
        goal={"value": 20, "label": "goal: under 20 µs"},
        rows=[{**row, "x_add": round(row["x_add"], 1)} for row in rows],
    )


if __name__ == "__main__":
    main()
