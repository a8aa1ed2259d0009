"""Benchmark what ``speed_report`` adds to a training step: ratios in one run.

Run ``python benchmarks/bench_speed_report.py`` (``--quick`` for a smoke run,
``--device cuda`` on a GPU machine, ``--dtype fp32`` for the fastest step, where the
meter's share is largest; ``--dtype`` again for several; ``--json PATH`` writes the data
file of ``docs/figures/bench_speed_report.json``, which ``scripts/make_figures.py`` draws
and ``scripts/bench_tables.py`` turns into the table of docs/benchmarks.md; ``--one meter
200`` runs only that many calls of one variant, for an instruction count under valgrind's
callgrind). The step is the 64-wide
MLP (batch 32, AdamW) of ``bench_autocast_step.py``, decorated with ``@autocast_step``;
the meter wraps that same decorated function, so both variants run the very same model,
optimizer and tensors, and the only difference is the meter. Variants:

* ``@autocast_step`` alone (the baseline);
* ``@speed_report`` above it, counting samples and FLOPs (a ``FlopCount`` scaled per
  sample), with its line built every 100 steps (``file=None``: the line is made and
  kept, not printed);
* the ``with meter.measure(x):`` form around the same call;
* the 1024-wide MLP (batch 256) with and without the meter, for scale.

The variants take turns in short blocks of steps (``--block`` seconds), in a rotating
order, for ``--rounds`` rounds; the table shows the median time per step and the
median over rounds of its ratio to the baseline of the same width. ``--clock cpu``
times with the process's CPU time (shared CPU machines). The last lines count the
host reads (``item``, ``bool``, ``tolist``) of twenty metered steps of the sync-free
guarded step (fused AdamW), as the tests do, and the meter's own cost per call, as a
share of the step, measured twice: around a function that does nothing ("alone"), and
in place, inside the metered 64-wide step, as a timer outside the metered call less
one inside it (less the same for a plain function in the meter's place). On a busy
machine the side-by-side ratio moves by a percent or two from run to run; these two
costs do not. The in-place cost is the larger (about twice, on a 2-core VM): between
steps the meter runs with the caches the step left.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import cudakit  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _report
from bench_autocast_step import mlp, resolve_dtype  # the same model as that benchmark

from cudakit.amp import autocast_step
from cudakit.speed import count_flops, speed_report

Step = Callable[[], Any]


def variants(width: int, batch: int, device: torch.device, dtype: torch.dtype) -> dict[str, Step]:
    """The baseline step and the metered forms of the very same decorated function."""
    model = mlp(width, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(batch, 64, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)

    @autocast_step(opt, dtype=dtype)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    flops = count_flops(step, x, y, model=model)
    metered = speed_report(samples=len, flops=flops, every=100, file=None)(step)
    block = speed_report(samples=len, flops=flops, step=step, every=100, file=None)

    def with_form() -> None:
        with block.measure(x):
            step(x, y)

    name = f"MLP {width} wide, batch {batch}"
    out = {
        f"{name} | @autocast_step": lambda: step(x, y),
        f"{name} | @speed_report over it": lambda: metered(x, y),
    }
    if width == 64:
        out[f"{name} | with meter.measure(x)"] = with_form
    return out


def isolated_cost(
    device: torch.device, dtype: torch.dtype, clock: Callable[[], float]
) -> tuple[float, float]:
    """Seconds the meter adds to one call (decorator, ``with`` form), around a no-op.

    The same settings as the metered step (samples, a FlopCount, the step's windows, a
    line built every 100 steps); the least over repeats of the difference to the bare
    function, which a busy machine can only make larger.
    """
    model = mlp(64, device)
    step = autocast_step(torch.optim.AdamW(model.parameters(), lr=1e-4), dtype=dtype)
    x = torch.randn(32, 64, device=device)

    def noop(x: torch.Tensor) -> None:
        return None

    flops = count_flops(lambda x: model(x).sum(), x, model=model)
    metered = speed_report(samples=len, flops=flops, step=step, every=100, file=None)(noop)
    block = speed_report(samples=len, flops=flops, step=step, every=100, file=None)

    def with_form(x: torch.Tensor) -> None:
        with block.measure(x):
            noop(x)

    n, best = 20_000, [float("inf"), float("inf")]
    for _ in range(7):
        t0 = clock()
        for _ in range(n):
            noop(x)
        bare = clock() - t0
        for i, fn in enumerate((metered, with_form)):
            t0 = clock()
            for _ in range(n):
                fn(x)
            best[i] = min(best[i], (clock() - t0 - bare) / n)
    return best[0], best[1]


def in_place_cost(device: torch.device, dtype: torch.dtype, blocks: int) -> tuple[float, float]:
    """Seconds the meter adds to each call inside the loop, and the step's own seconds.

    The 64-wide step, metered as in the side-by-side run, with a timer inside the
    metered call (around the step alone) and one outside it (around the whole metered
    call). A block is 1,600 calls, a whole number of the meter's batches of queued
    calls (64) and of its log interval (100), so its mean gap between the two timers
    holds the meter's batch work and its line in their share; the figure is the median
    over ``blocks`` blocks of that mean, less the same for a plain function in the
    meter's place (the timers' own cost), in blocks taken in turns. Both timers time
    the same call, so a slow spell of the machine, which moves the side-by-side ratio
    by a percent or two, cancels out; what remains is the meter's work as it runs
    between steps, with the caches the step left (on a 2-core VM about twice its cost
    around a no-op). On a GPU it is the meter's host work (its event records), which
    is the step's cost when the step is launch-bound.
    """
    model = mlp(64, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 64, generator=gen).to(device)
    y = torch.randint(0, 10, (32,), generator=gen).to(device)

    @autocast_step(opt, dtype=dtype)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    inner: list[int] = []
    now = time.perf_counter_ns

    @functools.wraps(step)
    def timed(x: torch.Tensor, y: torch.Tensor) -> Any:
        t0 = now()
        out = step(x, y)
        inner.append(now() - t0)
        return out

    def passthrough(x: torch.Tensor, y: torch.Tensor) -> Any:
        return timed(x, y)  # the same call, without the meter: the timers' own cost

    flops = count_flops(step, x, y, model=model)
    metered = speed_report(samples=len, flops=flops, every=100, file=None)(timed)
    means: dict[Any, list[float]] = {metered: [], passthrough: []}
    steps: list[float] = []
    calls = 1600
    for fn in means:
        for _ in range(calls):  # a whole block first: the meter's position in its cycles
            fn(x, y)
    gc.collect()
    gc.disable()
    try:
        for _ in range(blocks):
            for fn, block_means in means.items():
                inner.clear()
                t_total = 0
                for _ in range(calls):
                    t0 = now()
                    fn(x, y)
                    t_total += now() - t0
                block_means.append((t_total - sum(inner)) / calls)
                steps.append(statistics.median(inner))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        gc.enable()
    cost = statistics.median(means[metered]) - statistics.median(means[passthrough])
    return cost / 1e9, statistics.median(steps) / 1e9


def host_reads(device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """Host reads in 20 metered steps of the sync-free guarded step, and the steps taken."""

    class Reads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            if getattr(func, "__name__", "") in ("item", "__bool__", "tolist"):
                self.n += 1
            return func(*args, **(kw or {}))

    model = mlp(64, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(32, 64, device=device)
    y = torch.randint(0, 10, (32,), device=device)

    @speed_report(samples=len, flops=1e6, every=None, file=None)
    @autocast_step(opt, dtype=dtype)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    with Reads() as reads:
        for _ in range(20):
            step(x, y)
    return reads.n, step.speed_report.steps


def time_case(
    steps: dict[str, Step],
    args: argparse.Namespace,
    rounds: int,
    clock: Callable[[], float],
    sync: Callable[[], None],
) -> dict[str, list[float]]:
    """Seconds per step of each variant, one figure per round, the variants taking turns."""
    for fn in steps.values():  # warm up every variant
        for _ in range(10):
            fn()
    sync()
    per = {}
    for key, fn in steps.items():
        t0 = clock()
        for _ in range(20):
            fn()
        sync()
        per[key] = max((clock() - t0) / 20, 1e-7)
    blocks = {k: max(1, int(args.block / p)) for k, p in per.items()}
    reps = 2 if args.quick else 6
    keys = list(steps)
    times: dict[str, list[float]] = {k: [] for k in keys}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            totals = dict.fromkeys(keys, 0.0)
            for rep in range(reps):
                # A different variant goes first each time, and each follows each.
                order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
                for key in order if rep % 2 == 0 else order[::-1]:
                    fn, n = steps[key], blocks[key]
                    sync()
                    t0 = clock()
                    for _ in range(n):
                        fn()
                    sync()
                    totals[key] += (clock() - t0) / n
            for key in keys:
                times[key].append(totals[key] / reps)
    finally:
        gc.enable()
    return times


def run(
    args: argparse.Namespace, name: str, rounds: int, clock: Callable[[], float]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One precision: print its table and notes; return its rows for the chart, and the
    step's time, the meter's own cost per call and the host reads."""
    device = torch.device(args.device)
    dtype = resolve_dtype(name, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {}
    # One case at a time: a 1024-wide step between two 64-wide ones would leave the
    # caches cold for whichever 64-wide variant comes next.
    for width, batch in ((64, 32), (1024, 256)):
        times.update(time_case(variants(width, batch, device, dtype), args, rounds, clock, sync))
    keys = list(times)
    label = str(dtype).removeprefix("torch.")
    print(
        f"# torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, device {device}, threads {torch.get_num_threads()}, "
        f"{rounds} rounds, {args.clock} clock, {label}"
    )
    print("| case | implementation | median per step | ratio to @autocast_step |")
    print("|---|---|---:|---:|")
    rows: list[dict[str, Any]] = []
    for key in keys:
        case, impl = key.split(" | ")
        base = f"{case} | @autocast_step"
        ratio = statistics.median(a / b for a, b in zip(times[key], times[base], strict=True))
        med = statistics.median(times[key]) * 1e6
        print(f"| {case} | {impl} | {med:.1f} µs | {ratio:.3f} |")
        if impl != "@autocast_step":
            # The 1024-wide step is the control: the meter is 0.01 % of it, so what its
            # ratio shows beyond that is the noise of the side-by-side figures.
            wide = "" if case.startswith("MLP 64 ") else ", 1024 wide (control)"
            group = f"side by side{wide}: {impl}"
            rows.append({"group": group, "series": label, "value": round(100 * (ratio - 1), 2)})
    step_time = statistics.median(times[keys[0]])
    costs = isolated_cost(device, dtype, clock)
    meter_us = {}
    for form, cost in zip(("@speed_report", "with meter.measure(x)"), costs, strict=True):
        print(
            f"# the meter alone ({form}) around a function that does nothing: "
            f"{cost * 1e6:.2f} µs per call, {cost / step_time:.2%} of the 64-wide step's "
            f"{step_time * 1e6:.0f} µs"
        )
        share = round(100 * cost / step_time, 2)
        rows.append({"group": f"the meter alone: {form}", "series": label, "value": share})
        meter_us[form] = round(cost * 1e6, 2)
    in_place, own = in_place_cost(device, dtype, 1 if args.quick else 5)
    print(
        f"# the meter in place (@speed_report, a timer outside the metered call less one "
        f"inside it): {in_place * 1e6:.2f} µs per call, {in_place / own:.2%} of the step's "
        f"{own * 1e6:.0f} µs there"
    )
    rows.append(
        {
            "group": "the meter in place: @speed_report",
            "series": label,
            "value": round(100 * in_place / own, 2),
        }
    )
    reads, n = host_reads(device, dtype)
    print(f"# host reads in {n} metered optimizer steps (sync-free guarded step): {reads}")
    step = {
        "series": label,
        "step_us": round(step_time * 1e6, 1),
        "meter_us": meter_us,
        "in_place_us": {"@speed_report": round(in_place * 1e6, 2)},
        "host_reads": reads,
        "metered_steps": n,
    }
    return rows, step


def run_one(variant: str, steps: int, args: argparse.Namespace) -> None:
    """Only ``steps`` calls of one variant, after 50 warm-up calls: for an instruction count.

    ``valgrind --tool=callgrind python benchmarks/bench_speed_report.py --one bare 200``
    against ``--one meter 200`` (and ``--one bare 0`` for the set-up) counts what the
    meter adds per step, unmoved by other tenants of the machine.
    """
    device = torch.device(args.device)
    dtype = resolve_dtype((args.dtype or ["bf16"])[0], device)
    fns = variants(64, 32, device, dtype)
    name = "@autocast_step" if variant == "bare" else "@speed_report over it"
    (fn,) = [f for k, f in fns.items() if k.endswith(f"| {name}")]
    for _ in range(50 + steps):
        fn()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32", "auto"),
        action="append",
        help="precision of the step; repeat for several (default: bf16)",
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--block", type=float, default=0.02, help="seconds of steps per turn")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument(
        "--json",
        "--figure",
        dest="json",
        default=None,
        metavar="PATH",
        help="also write the data file (docs/figures/bench_speed_report.json)",
    )
    parser.add_argument(
        "--one",
        nargs=2,
        metavar=("VARIANT", "STEPS"),
        help="only run STEPS calls of VARIANT (bare or meter), e.g. under callgrind",
    )
    args = parser.parse_args(argv)
    if args.one is not None:
        variant, steps = args.one
        if variant not in ("bare", "meter") or not steps.isdigit():
            parser.error("--one takes bare or meter, then a number of steps")
        torch.set_num_threads(args.threads)
        run_one(variant, int(steps), args)
        return
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu measures host work only; use the wall clock with --device cuda")
    if not args.block > 0:
        parser.error("--block must be a positive number of seconds")
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 21)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    load = _report.load_average()
    rows: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    for name in args.dtype or ["bf16"]:
        more, step = run(args, name, rounds, clock)
        rows += more
        steps.append(step)
    if args.json is not None:
        settings = (
            f"device {args.device}, {torch.get_num_threads()} thread(s), {rounds} rounds, "
            f"{args.clock} clock"
        )
        _report.write(args.json, figure_data(rows, steps, settings, argv, load))


def figure_data(
    rows: list[dict[str, Any]],
    steps: list[dict[str, Any]],
    settings: str,
    argv: list[str] | None,
    load: float,
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_speed_report.json."""
    return _report.record(
        "benchmarks/bench_speed_report.py",
        title="speed_report: what the meter adds to the 64-wide MLP step",
        settings=settings,
        argv=argv,
        load_before=load,
        unit="% added to the step",
        goal={"value": 1, "label": "goal: at most 1 %"},
        steps=steps,
        rows=rows,
    )


if __name__ == "__main__":
    main()
