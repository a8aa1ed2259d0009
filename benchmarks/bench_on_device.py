"""Benchmark ``cudakit.device.on_device`` against a minimal hand-written recursion and peers.

Run ``python benchmarks/bench_on_device.py`` (``--quick`` for a smoke run,
``--device cuda`` on a GPU machine). One process; every round times each
implementation on each case in turn (interleaved, so drift hits all of them
alike); the table shows the median time per call and its ratio to the
hand-written recursion. Peers (accelerate's ``send_to_device``, lightning-fabric's
``move_data_to_device``, ``optree.tree_map``) are included when importable.

Cases: (a) a batch dict of 4 tensors plus non-tensor values, (b) 100 lists of 10
tensors, (c) a list of 10,000 tensors; each moved to the target device (``meta``
by default: the real allocation path without a GPU), to the CPU it lives on
(nothing to move), and, with data already on the target, to the target (nothing
to move either: on a GPU the per-call cost of a training loop whose batches are
already on the device; with ``meta`` the same path without a GPU).

``--clock wall`` (the default) times with ``time.perf_counter``; ``--clock cpu``
counts only the CPU time of the timing thread (``time.thread_time``), so time
slices other processes take on a shared machine do not count. With a CUDA target
use ``wall``: the CPU time would not include waiting for the copies.

``--json PATH`` also writes the figures, the machine and the date as the data file of
``docs/figures/bench_on_device.json``: ``python scripts/make_figures.py`` redraws the chart
from it and ``python scripts/bench_tables.py`` the table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    from cudakit.device import on_device
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cudakit.device import on_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

Mover = Callable[[Any, torch.device], Any]


def hand_written(x: Any, device: torch.device) -> Any:
    """The minimal recursion everyone writes first."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: hand_written(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [hand_written(v, device) for v in x]
    if isinstance(x, tuple):
        return tuple(hand_written(v, device) for v in x)
    return x


def movers() -> dict[str, Mover]:
    out: dict[str, Mover] = {
        "hand-written": hand_written,
        "cudakit": lambda x, d: on_device(x, device=d),
    }
    try:
        from accelerate.utils import send_to_device

        out["accelerate"] = lambda x, d: send_to_device(x, d)
    except Exception:  # not installed, or broken against this torch
        pass
    try:
        from lightning_fabric.utilities.apply_func import move_data_to_device

        out["lightning-fabric"] = lambda x, d: move_data_to_device(x, d)
    except Exception:
        pass
    try:
        import optree

        def optree_move(x: Any, d: torch.device) -> Any:
            return optree.tree_map(
                lambda t: t.to(d) if isinstance(t, torch.Tensor) else t, x, none_is_leaf=True
            )

        out["optree"] = optree_move
    except Exception:
        pass
    return out


def cases(source: torch.device) -> dict[str, Any]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=source)

    return {
        "(a) batch dict": {
            "input_ids": t(8, 128),
            "attention_mask": t(8, 128),
            "labels": t(8),
            "pixel_values": t(8, 3, 32, 32),
            "ids": ["a", "b", "c", "d", "e", "f", "g", "h"],
            "epoch": 3,
            "split": "train",
            "meta": None,
        },
        "(b) 100 lists x 10": [[t(4, 4) for _ in range(10)] for _ in range(100)],
        "(c) list of 10,000": [t(4) for _ in range(10_000)],
    }


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_call(
    fn: Mover, data: Any, device: torch.device, number: int, clock: Callable[[], float]
) -> float:
    sync = device.type == "cuda" or any(
        isinstance(v, torch.Tensor) and v.is_cuda for v in (data if isinstance(data, list) else [])
    )
    start = clock()
    for _ in range(number):
        fn(data, device)
    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    return (clock() - start) / number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rounds: a smoke run")
    parser.add_argument("--device", default="meta", help="target device (meta, cuda, ...)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: perf_counter (default); cpu: this thread's CPU time (shared machines)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the data file")
    args = parser.parse_args(argv)
    load = _report.load_average()
    clock = CLOCKS[args.clock]
    target = torch.device(args.device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    rounds = args.rounds or (3 if args.quick else 25)
    impls = movers()
    # "move": data on the CPU, target the device; "stay": data already where it goes.
    # Named "source to target": the last two have nothing to move.
    scenarios: list[tuple[str, torch.device, torch.device]] = [
        (f"cpu to {target}", torch.device("cpu"), target),
        ("cpu to cpu", torch.device("cpu"), torch.device("cpu")),
    ]
    if target.type != "cpu":
        scenarios.append((f"{target} to {target}", target, target))
    rows: list[tuple[str, str, str, float, float]] = []
    for scen, source, dest in scenarios:
        for case, data in cases(source).items():
            # Calibrate so one timing covers ~10 ms (~2 ms with --quick).
            per = max(time_call(hand_written, data, dest, 1, clock), 1e-7)
            number = max(1, int((0.002 if args.quick else 0.01) / per))
            for fn in impls.values():  # warm up (first calls load kernels)
                time_call(fn, data, dest, 1, clock)
            samples: dict[str, list[float]] = {name: [] for name in impls}
            gc.collect()
            for _ in range(rounds):
                for name, fn in impls.items():
                    samples[name].append(time_call(fn, data, dest, number, clock))
            base = statistics.median(samples["hand-written"])
            for name in impls:
                med = statistics.median(samples[name])
                rows.append((scen, case, name, med, med / base))
    print(
        f"# on_device benchmark: {platform.machine()} {platform.system()}, "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, "
        f"{rounds} interleaved rounds, median per call ({args.clock} clock)"
    )
    print()
    print("| from, to | case | implementation | time per call | vs hand-written |")
    print("|---|---|---|---:|---:|")
    for scen, case, name, med, ratio in rows:
        print(f"| {scen} | {case} | {name} | {med * 1e6:,.1f} µs | {ratio:.2f}x |")
    cudakit_worst = max(r[4] for r in rows if r[2] == "cudakit")
    print()
    print(f"cudakit worst ratio: {cudakit_worst:.2f}x (goal: <= 1.10x)")
    times = {(scen, case, name): med for scen, case, name, med, _ in rows}
    for peer in [name for name in impls if name not in ("hand-written", "cudakit")]:
        behind = [
            f"{scen} {case} ({times[scen, case, 'cudakit'] / times[scen, case, peer]:.2f}x)"
            for scen, case, name in times
            if name == peer and times[scen, case, "cudakit"] >= times[scen, case, peer]
        ]
        verdict = "ahead on every case" if not behind else "behind on " + ", ".join(behind)
        print(f"cudakit vs {peer}: {verdict}")
    if args.json:
        _report.write(args.json, figure_data(rows, rounds, args.clock, argv, load))
    return 0


def figure_data(
    rows: list[tuple[str, str, str, float, float]],
    rounds: int,
    clock: str,
    argv: list[str] | None,
    load: float,
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_on_device.json."""
    return _report.record(
        "benchmarks/bench_on_device.py",
        title="on_device and its peers, time per call against the hand-written recursion",
        settings=f"{rounds} interleaved rounds, median time per call, {clock} clock",
        argv=argv,
        load_before=load,
        peers=("accelerate", "lightning-fabric", "optree"),
        reference="hand-written",
        group_by=["move", "case"],
        ratio="median time divided by the reference's median time",
        rows=[
            {
                "move": scen,
                "case": case,
                "implementation": name,
                "time_us": round(med * 1e6, 2),
                "ratio": round(ratio, 3),
            }
            for scen, case, name, med, ratio in rows
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
