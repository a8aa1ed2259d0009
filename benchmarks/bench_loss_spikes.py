"""Benchmark what ``autocast_step(skip_spikes=...)`` adds to the sync-free step.

Run ``python benchmarks/bench_loss_spikes.py`` (``--quick`` for a smoke run, ``--device
cuda`` on a GPU machine). The step is the 64-wide MLP of ``bench_autocast_step.py``
(batch 32) with fused AdamW, so the non-finite guard takes the sync-free path; it is
timed without spike skipping and with it (the loss, the gradient norm, both), with
clipping off and on. On the CPU the sync-free path reads its verdict from memory at
once (``host``); ``--paths host,device`` adds the GPU's path forced on the CPU
(``device``: the verdict, and the spike test, stay on the device and are read one
window later), where the spike test's extra kernels are eager CPU ops.

Every variant is built ``--sets`` times in this one process, and each instance is timed
in short blocks of ``--block`` steps with its spike rule and without it (the rule set
aside for the block: the very same step, heap and tensors, only the code path differs;
the difference measured is a few microseconds of host work, which the differences
between instances, up to 4% on a busy shared machine, would drown). The variants take
turns, several times a round, a different one first each time, so a slow spell hits
them all alike. The table shows the median time per step without and with the rule, and
the median over rounds of their ratio. ``--clock cpu`` (the default on the CPU; ``wall``
on a GPU) times with the process's CPU time: time spent descheduled no longer counts.
``--json PATH`` also writes the figures, the machine and the date as the data file of
``docs/figures/bench_loss_spikes.json`` (chart: ``scripts/make_figures.py``; table of
docs/benchmarks.md: ``scripts/bench_tables.py``).
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
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

try:
    import cudakit.amp._stepper as amp_stepper
    from cudakit.amp import autocast_step
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cudakit.amp._stepper as amp_stepper
    from cudakit.amp import autocast_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

Step = Callable[[torch.Tensor, torch.Tensor], Any]
SPIKES: dict[str, Any] = {
    "off": False,
    "loss": "loss",
    "grad_norm": "grad_norm",
    "both": ("loss", "grad_norm"),
}


class Spec(NamedTuple):
    path: str  # "host" or "device"
    spikes: str  # a key of SPIKES
    clip: bool
    device: str
    dtype: str
    compiled: bool = False  # autocast_step(compile=True)


def build(spec: Spec) -> tuple[Step, Any]:
    """One fresh instance of the variant: the decorated step, and its rule's holder."""
    from cudakit.amp import SpikeRule

    device, dtype = torch.device(spec.device), getattr(torch, spec.dtype)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    ).to(device)  # fmt: skip
    # lr=0: the same work per step (AdamW still runs in full), on weights that stay
    # put, so the statistics are steady and no window is a spike: the rule is timed on
    # the path every good window takes, however many steps a run makes with it off.
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)
    on = SPIKES[spec.spikes]
    rule = SpikeRule(on=on, warmup=2) if on else False  # judged from the third window on
    waits = amp_stepper.host_read_waits
    if spec.path == "device":
        amp_stepper.host_read_waits = lambda device_type: True  # type: ignore[assignment]
    try:
        step = autocast_step(
            opt,
            dtype=dtype,
            max_grad_norm=1.0 if spec.clip else None,
            skip_spikes=rule,
            compile={"fullgraph": True} if spec.compiled else False,
        )
    finally:
        amp_stepper.host_read_waits = waits  # type: ignore[assignment]
    if not step.sync_free or step._stepper.lazy != (spec.path == "device"):
        raise RuntimeError(f"{spec}: not the sync-free {spec.path} path")

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    return train, step._stepper


def in_place(fn: Step, stepper: Any, x: torch.Tensor, y: torch.Tensor, rounds: int) -> float:
    """Seconds the rule adds to each window where it runs: ``finish()`` timed in place.

    The stepper's ``finish`` (the end of a window: the previous window's verdict read,
    this one's checked, judged and stepped, where all of the rule's work happens) is
    timed on each call, in blocks of 50 steps with the rule and without it in turns, on
    the same instance: the difference of the medians. Unlike the time per step, it
    leaves out the forward and backward passes, whose time varies from block to block
    on a shared machine, and so stays steady where the ratio moves. On a GPU it is the
    host time, which is the step's time when the step is launch-bound.
    """
    now = time.perf_counter_ns
    finish = stepper.finish
    times: list[int] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = now()
        out = finish(*args, **kwargs)
        times.append(now() - t0)
        return out

    rule = stepper.watch.spikes
    per: dict[bool, list[int]] = {False: [], True: []}
    stepper.finish = timed
    try:
        for r in range(rounds):
            for on in (r % 2 == 0, r % 2 == 1):
                stepper.judge.settle()
                stepper.watch.spikes = rule if on else None
                times.clear()
                for _ in range(50):
                    fn(x, y)
                per[on] += times[1:]  # (the first reads the other setting's verdict)
    finally:
        del stepper.finish
        stepper.judge.settle()
        stepper.watch.spikes = rule
    if stepper.counters.skipped:
        raise RuntimeError(
            f"{stepper.counters.skipped} window(s) were skipped while timing: the rule was "
            "not timed on the path of a good window"
        )
    return (statistics.median(per[True]) - statistics.median(per[False])) / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(spikes: str, steps: int, args: argparse.Namespace) -> None:
    """Only ``steps`` calls of one variant, after 50 warm-up calls: for an instruction count.

    ``valgrind --tool=callgrind python benchmarks/bench_loss_spikes.py --one off 200``
    against ``--one loss 200`` (and ``--one off 0`` for the set-up) counts what the rule
    adds per step, unmoved by other tenants of the machine.
    """
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    path = args.paths.split(",")[0]
    fn, _ = build(Spec(path, spikes, args.clip, args.device, dtype))
    gen = torch.Generator().manual_seed(1234)
    device = torch.device(args.device)
    x = torch.randn(32, 64, generator=gen).to(device)
    y = torch.randint(0, 10, (32,), generator=gen).to(device)
    for _ in range(50 + steps):
        fn(x, y)
    sync(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--paths", default="host", help="host, device or host,device")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--block", type=int, default=10, help="steps per timed block")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default=None,
        help="cpu: the process's CPU time (the default on the CPU); wall (the default on a GPU)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--one",
        nargs=2,
        metavar=("SKIP_SPIKES", "STEPS"),
        help="only run STEPS calls with skip_spikes off, loss, grad_norm or both (the first of "
        "--paths; --clip for clipping), e.g. under callgrind",
    )
    parser.add_argument("--clip", action="store_true", help="with --one: max_grad_norm=1.0")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also the device path with clipping under compile=True, where the spike test "
        "is judged inside the compiled region",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the data file")
    args = parser.parse_args(argv)
    load = _report.load_average()
    if args.one is not None:
        spikes, steps = args.one
        if spikes not in SPIKES or not steps.isdigit():
            parser.error("--one takes off, loss, grad_norm or both, then a number of steps")
        torch.set_num_threads(args.threads)
        run_one(spikes, int(steps), args)
        return
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= {"host", "device"}:
        parser.error("--paths takes host, device or host,device")
    if args.clock is None:  # scripts/gpu-check runs every benchmark with --device cuda alone
        args.clock = "cpu" if args.device == "cpu" else "wall"
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu measures host work only; use --clock wall with --device cuda")
    if args.device != "cpu":
        paths = ["device"]  # a GPU's sync-free path is the device one
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    rounds = args.rounds or (3 if args.quick else 31)
    specs = [
        Spec(path, spikes, clip, args.device, dtype)
        for path in paths
        for clip in (False, True)
        for spikes in SPIKES
        if spikes != "off"
    ]
    if args.compile:  # the region compile= compiles: the device path, with clipping
        specs += [
            Spec("device", spikes, True, args.device, dtype, compiled=True)
            for spikes in SPIKES
            if spikes != "off"
        ]
    built = {spec: [build(spec) for _ in range(args.sets)] for spec in specs}
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 64, generator=gen).to(device)
    y = torch.randint(0, 10, (32,), generator=gen).to(device)
    for group in built.values():
        for fn, _ in group:
            for _ in range(10):
                fn(x, y)
    sync(device)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    reps = 2 if args.quick else 10
    times: dict[tuple[Spec, bool], list[float]] = {(s, on): [] for s in specs for on in (0, 1)}

    def block(fn: Step) -> float:
        sync(device)
        t0 = clock()
        for _ in range(args.block):
            fn(x, y)
        sync(device)
        return clock() - t0

    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            totals = dict.fromkeys(times, 0.0)
            for rep in range(reps):
                shift = rep % len(specs)
                for spec in specs[shift:] + specs[:shift]:
                    for fn, stepper in built[spec]:
                        # The same instance with the rule and without it, in turn: only
                        # the code path differs, not the heap or the tensors.
                        rule = stepper.watch.spikes
                        for on in (rep % 2, 1 - rep % 2):
                            stepper.judge.settle()  # (the device path's pending verdicts first)
                            stepper.watch.spikes = rule if on else None
                            totals[spec, on] += block(fn)
                        stepper.judge.settle()
                        stepper.watch.spikes = rule
            for key in times:
                times[key].append(totals[key] / (reps * args.sets * args.block))
    finally:
        gc.enable()

    gc.collect()
    gc.disable()
    try:
        placed = {spec: in_place(*built[spec][0], x, y, 4 if args.quick else 40) for spec in specs}
    finally:
        gc.enable()
    print(
        f"# torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, device {args.device}, {dtype}, threads {args.threads}, "
        f"{rounds} rounds, {args.sets} sets, {args.clock} clock"
    )
    print("| path | clipping | skip_spikes | without | with | ratio | in place |")
    print("|---|---|---|---:|---:|---:|---:|")
    rows = []
    for spec in specs:
        off, on = times[spec, 0], times[spec, 1]
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        share = placed[spec] / statistics.median(off)
        print(
            f"| {spec.path}{', compile=True' if spec.compiled else ''} "
            f"| {'on' if spec.clip else 'off'} | {spec.spikes} "
            f"| {statistics.median(off) * 1e6:.1f} µs | {statistics.median(on) * 1e6:.1f} µs "
            f"| {statistics.median(ratios):.3f} | {placed[spec] * 1e6:.1f} µs ({share:.1%}) |"
        )
        rows.append(
            {
                "clipping": "on" if spec.clip else "off",
                "skip_spikes": spec.spikes,
                "implementation": f"cudakit, {spec.path} path"
                + (", compile=True" if spec.compiled else ""),
                "path": spec.path + (", compile=True" if spec.compiled else ""),
                "without_us": round(statistics.median(off) * 1e6, 2),
                "time_us": round(statistics.median(on) * 1e6, 2),
                "ratio": round(statistics.median(ratios), 4),
                "in_place_us": round(placed[spec] * 1e6, 2),
            }
        )
    if args.json:
        settings = (
            f"device {args.device}, {dtype}, {args.threads} thread(s), {rounds} rounds, "
            f"{args.sets} sets, blocks of {args.block} steps, {args.clock} clock"
        )
        _report.write(args.json, figure_data(rows, settings, argv, load))


def figure_data(
    rows: list[dict[str, Any]], settings: str, argv: list[str] | None, load: float
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_loss_spikes.json."""
    return _report.record(
        "benchmarks/bench_loss_spikes.py",
        title="skip_spikes: time per step with the rule against without it",
        settings=settings,
        argv=argv,
        load_before=load,
        reference="without the rule",
        group_by=["clipping", "skip_spikes"],
        ratio="median over rounds of the time with the rule divided by the time without",
        rows=rows,
    )


if __name__ == "__main__":
    main()
