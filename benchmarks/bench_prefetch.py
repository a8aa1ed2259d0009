"""Benchmark cudakit.data.prefetch.

CPU mode (default): the per-batch cost of ``prefetch(loader, device="cpu")`` over a
plain ``for batch in loader`` loop, for a DataLoader of small batches (the goal: at
most 3 percent) and for a list of ready batches (the harshest case: nothing to hide
the overhead behind). Rounds are interleaved in one process; medians are reported.
``--clock cpu`` counts the timing thread's CPU time instead of the wall clock (the loader
runs in that thread, ``num_workers=0``), so time other processes take on a shared machine
does not count.

GPU mode (``--device cuda``): a data-bound loop, each step one host-to-device copy
of a batch and a compute kernel sized to a multiple of the copy time. Without
prefetch the copy and the compute run one after the other; with prefetch they
overlap, and the goal is a step time within 10 percent of max(copy, compute).

    python benchmarks/bench_prefetch.py            # CPU overhead
    python benchmarks/bench_prefetch.py --quick    # smoke run
    python benchmarks/bench_prefetch.py --device cuda

``--json PATH`` also writes the figures, the machine and the date as the data file of
``docs/figures/bench_prefetch.json`` (chart: ``scripts/make_figures.py``; table of
docs/benchmarks.md: ``scripts/bench_tables.py``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    from cudakit.data import prefetch
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cudakit.data import prefetch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def _consume(batches: Iterable[Any], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    for _ in batches:
        pass
    return clock() - start


def _interleaved(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            times[name].append(run())
    return times


def bench_cpu(quick: bool, rounds: int | None = None, clock: str = "wall") -> dict[str, Any]:
    """Time the CPU overhead, print its table; return the data file's fields."""
    torch.set_num_threads(1)
    rounds = rounds or (5 if quick else 31)
    n_samples = 2_048 if quick else 16_384
    rows = []
    for batch_size in (8, 32, 128):
        ds = TensorDataset(torch.randn(n_samples, 16), torch.randint(0, 10, (n_samples,)))
        loader = DataLoader(ds, batch_size=batch_size)
        ready = list(loader)
        wrapped_loader = prefetch(loader, device="cpu")
        wrapped_ready = prefetch(ready, device="cpu")
        for source, plain, wrapped in (
            ("DataLoader", loader, wrapped_loader),
            ("list of batches", ready, wrapped_ready),
        ):
            _consume(plain)
            _consume(wrapped)  # warm-up
            t = _interleaved(
                {
                    "plain": lambda p=plain: _consume(p, CLOCKS[clock]),
                    "prefetch": lambda w=wrapped: _consume(w, CLOCKS[clock]),
                },
                rounds,
            )
            n = len(plain)  # type: ignore[arg-type]
            ratios = [w / p for w, p in zip(t["prefetch"], t["plain"], strict=True)]
            extra = [(w - p) / n * 1e6 for w, p in zip(t["prefetch"], t["plain"], strict=True)]
            rows.append(
                (
                    source,
                    batch_size,
                    statistics.median(t["plain"]) / n * 1e6,
                    statistics.median(t["prefetch"]) / n * 1e6,
                    statistics.median(extra),
                    (statistics.median(ratios) - 1) * 100,
                )
            )
    print(
        f"prefetch CPU overhead ({platform.machine()}, {torch.get_num_threads()} thread, "
        f"torch {torch.__version__}, Python {platform.python_version()}; "
        f"median of {rounds} interleaved rounds, {clock} clock)"
    )
    print()
    print("| source | batch | plain us/batch | prefetch us/batch | extra us/batch | overhead |")
    print("|---|---:|---:|---:|---:|---:|")
    worst_loader = 0.0
    for source, bs, plain_us, pref_us, extra_us, pct in rows:
        # A list's own iteration costs next to nothing, so a percentage means nothing there.
        share = f"{pct:+.1f}%" if source == "DataLoader" else "n/a"
        print(f"| {source} | {bs} | {plain_us:.1f} | {pref_us:.1f} | {extra_us:.2f} | {share} |")
        if source == "DataLoader":
            worst_loader = max(worst_loader, pct)
    ok = worst_loader <= 3.0
    print()
    print(f"goal: DataLoader overhead <= 3%: {'met' if ok else 'NOT met'} ({worst_loader:+.1f}%)")
    return cpu_figure_data(rows, rounds, clock)


def cpu_figure_data(
    rows: list[tuple[str, int, float, float, float, float]], rounds: int, clock: str = "wall"
) -> dict[str, Any]:
    """The CPU run's chart rows (the DataLoader's), its table, title and settings."""
    chart = [
        {"group": f"{source}, batch {bs}", "series": series, "value": round(us, 1)}
        for source, bs, plain_us, pref_us, _, _ in rows
        if source == "DataLoader"
        for series, us in (("plain loop", plain_us), ("prefetch", pref_us))
    ]
    table = [
        {
            "source": source,
            "batch": bs,
            "plain_us": round(plain_us, 1),
            "prefetch_us": round(pref_us, 1),
            "extra_us": round(extra_us, 2),
            "overhead_pct": round(pct, 1) if source == "DataLoader" else None,
        }
        for source, bs, plain_us, pref_us, extra_us, pct in rows
    ]
    return {
        "title": "prefetch on a CPU: time per batch with and without it",
        "settings": f"{torch.get_num_threads()} intra-op thread(s), median of {rounds} "
        f"interleaved rounds, {clock} clock",
        "unit": "µs per batch",
        "table": table,
        "rows": chart,
    }


def _time_cuda(fn: Callable[[], None], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def bench_cuda(quick: bool, device_spec: str) -> dict[str, Any]:
    """Time the copy/compute overlap on a GPU, print its table; return the data's fields."""
    from cudakit.device import resolve_device

    device = resolve_device(device_spec)
    steps = 20 if quick else 60
    rounds = 3 if quick else 7
    numel = (16 if quick else 64) * (1 << 20) // 4  # 16 or 64 MiB of float32 per batch
    dim = 1024
    rows_per_batch = numel // dim
    pinned = [torch.randn(rows_per_batch, dim).pin_memory() for _ in range(4)]
    pageable = [torch.randn(rows_per_batch, dim) for _ in range(4)]
    w = torch.randn(dim, dim, device=device) / dim**0.5
    resident = pinned[0].to(device)

    def batches(pool: list[torch.Tensor]) -> list[torch.Tensor]:
        return [pool[i % len(pool)] for i in range(steps)]

    def compute(x: torch.Tensor, reps: int) -> None:
        for _ in range(reps):
            x = torch.tanh(x @ w)

    def copy_only() -> None:
        for x in batches(pinned):
            x.to(device, non_blocking=True)

    copy_s = statistics.median(_time_cuda(copy_only, device) for _ in range(rounds)) / steps

    def compute_for(reps: int) -> float:
        def run() -> None:
            for _ in range(steps):
                compute(resident, reps)

        return statistics.median(_time_cuda(run, device) for _ in range(rounds)) / steps

    one_rep = compute_for(1)
    print(
        f"prefetch on {torch.cuda.get_device_name(device)} (torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}); batch {numel * 4 / 2**20:.0f} MiB, {steps} steps, "
        f"median of {rounds} rounds"
    )
    print()
    print(
        "| compute/copy | source | copy ms | compute ms | no prefetch ms | prefetch ms "
        "| prefetch / max(copy, compute) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    chart: list[dict[str, Any]] = []
    for target in (0.5, 1.0, 2.0):
        reps = max(1, round(target * copy_s / one_rep))
        compute_s = compute_for(reps)
        for label, pool in (("pinned", pinned), ("pageable", pageable)):
            src = batches(pool)

            def plain(src: list[torch.Tensor] = src, reps: int = reps) -> None:
                for x in src:
                    compute(x.to(device, non_blocking=True), reps)

            def overlapped(src: list[torch.Tensor] = src, reps: int = reps) -> None:
                for x in prefetch(src, device=device, depth=2):
                    compute(x, reps)

            _time_cuda(overlapped, device)  # warm-up: streams, pinned host blocks
            t = _interleaved(
                {
                    "plain": lambda f=plain: _time_cuda(f, device),
                    "prefetch": lambda f=overlapped: _time_cuda(f, device),
                },
                rounds,
            )
            plain_s = statistics.median(t["plain"]) / steps
            pref_s = statistics.median(t["prefetch"]) / steps
            bound = max(copy_s, compute_s)
            ratio = pref_s / bound
            if label == "pinned":
                worst = max(worst, ratio)
            group = f"compute/copy {compute_s / copy_s:.2f}, {label}"
            for series, value in (("no prefetch", plain_s), ("prefetch", pref_s)):
                chart.append({"group": group, "series": series, "value": round(value * 1e3, 3)})
            print(
                f"| {compute_s / copy_s:.2f} | {label} | {copy_s * 1e3:.2f} | "
                f"{compute_s * 1e3:.2f} | {plain_s * 1e3:.2f} | {pref_s * 1e3:.2f} | "
                f"{ratio:.3f} |"
            )
    print()
    print(
        "goal: pinned prefetch step <= 1.10 x max(copy, compute): "
        f"{'met' if worst <= 1.10 else 'NOT met'} (worst {worst:.3f})"
    )
    return {
        "title": f"prefetch on {torch.cuda.get_device_name(device)}: time per step with and "
        "without it",
        "settings": f"batch {numel * 4 / 2**20:.0f} MiB, {steps} steps, median of {rounds} "
        f"rounds; copy {copy_s * 1e3:.2f} ms per batch",
        "unit": "ms per step",
        "rows": chart,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--device", default="cpu", help="cpu (overhead) or cuda[:N] (overlap)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: perf_counter (default); cpu: this thread's CPU time (shared machines; the "
        "CPU mode only)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the data file")
    args = parser.parse_args(argv)
    load = _report.load_average()
    if args.device.startswith("cuda"):
        if args.clock == "cpu":
            parser.error(
                "--clock cpu measures host work only; use the wall clock with --device cuda"
            )
        if not torch.cuda.is_available():
            print("--device cuda needs a CUDA GPU; this machine has none.", file=sys.stderr)
            return 2
        fields = bench_cuda(args.quick, args.device)
    else:
        fields = bench_cpu(args.quick, args.rounds, args.clock)
    if args.json:
        record = _report.record(
            "benchmarks/bench_prefetch.py", argv=argv, load_before=load, **fields
        )
        _report.write(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
