"""Benchmark a watched run against the plain hand-written loop: ratios in one run.

Run ``python benchmarks/bench_watching.py`` (``--quick`` for a smoke run, ``--device
cuda`` on a GPU machine; ``--dtype`` picks the precisions, fp32 and bf16 by default).
The step is the 64-wide MLP (batch 32, AdamW) of ``bench_autocast_step.py``, where
the host work of what watches the run weighs most. Every variant drives the very same
model, optimizer and tensors (so no difference of instances or heaps shows), and only
the code around the step differs:

* the hand-written loop: autocast (off for fp32), backward, ``opt.step()``,
  ``opt.zero_grad()``, the reference;
* ``@autocast_step`` alone (with its non-finite guard);
* each watching feature alone on it: ``@speed_report`` (samples and a ``FlopCount``,
  its line made every 100 steps and kept, ``file=None``); ``skip_spikes="loss"``;
  ``Checkpointer.maybe_save()`` after each call (its per-batch path: the count, the
  stop-signal poll, the test for a due save; saves themselves are
  ``bench_checkpoint.py``'s);
* all three on, as a real run has them.

The learning rate is 0, so the statistics stay steady and no window is a spike while
AdamW does all its work. The variants take turns in short blocks (``--block``
seconds), a different one first each time, for ``--rounds`` rounds; the table shows
the median time per step and the median over rounds of its ratio to the hand-written
loop. Each feature's own share is its variant's ratio to ``@autocast_step`` alone. The
goal: all three on at most 1.00 of the hand-written loop, fp32 and bf16.

bf16 runs natively only where the machine has the instructions (a CPU with AVX512-BF16
or AMX, a GPU that ``torch.cuda.is_bf16_supported()``); elsewhere it is emulated and
much slower, which the table says. That is decided by :func:`bf16_support` from
capabilities passed in, never assumed. ``--clock cpu`` (the default on the CPU) times
with the process's CPU time: time spent descheduled by other tenants no longer counts.
``--json PATH`` writes the data file of ``docs/figures/bench_watching.json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import cudakit  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _report
from bench_autocast_step import mlp  # the same model as that benchmark

from cudakit import Checkpointer
from cudakit.amp import SpikeRule, autocast_step
from cudakit.speed import count_flops, speed_report

Step = Callable[[], Any]
REFERENCE = "hand-written"
BARE = "@autocast_step"
FEATURES = ("+ speed_report", "+ skip_spikes", "+ maybe_save()")
ALL = "all three on"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bf16_support(device_type: str, cpu_flags: str = "", cuda_bf16: bool = False) -> str:
    """Whether bf16 runs natively here: ``"native"``, ``"emulated"`` or ``"unknown"``.

    From capabilities passed in (the CPU's flags, as ``/proc/cpuinfo`` lists them, and
    ``torch.cuda.is_bf16_supported()``), so that it is tested for every machine.

    >>> bf16_support("cpu", "fpu avx512f avx512_bf16"), bf16_support("cpu", "avx2 fma")
    ('native', 'emulated')
    >>> bf16_support("cuda", cuda_bf16=True), bf16_support("cpu")
    ('native', 'unknown')
    """
    if device_type == "cuda":
        return "native" if cuda_bf16 else "emulated"
    if not cpu_flags:
        return "unknown"
    flags = set(cpu_flags.split())
    return "native" if flags & {"avx512_bf16", "amx_bf16"} else "emulated"


def capabilities(device: torch.device) -> str:
    """This machine's bf16 support, read here and handed to :func:`bf16_support`."""
    if device.type == "cuda":
        return bf16_support("cuda", cuda_bf16=torch.cuda.is_bf16_supported())
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return bf16_support("cpu")
    lines = [ln for ln in text.splitlines() if ln.startswith("flags")]
    return bf16_support("cpu", lines[0].split(":", 1)[1] if lines else "")


Block = Callable[[int], None]


class Rig(NamedTuple):
    """The variants, and the parts :func:`in_place` times one by one."""

    blocks: dict[str, Block]
    train: Any  # the decorated step
    timed: Any  # the same, with a timer inside (its times go to ``inner``)
    inner: list[int]
    flops: Any
    spikes: Callable[[bool], None]
    stepper: Any
    maybe_save: Callable[[], Any]
    x: torch.Tensor
    y: torch.Tensor


def variants(device: torch.device, dtype: torch.dtype, directory: str) -> Rig:
    """Each variant as a block of ``n`` steps, all on one model, optimizer and tensors."""
    model = mlp(64, device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 64, generator=gen).to(device)
    y = torch.randint(0, 10, (32,), generator=gen).to(device)
    on = dtype != torch.float32
    step = autocast_step(opt, dtype=dtype, skip_spikes=SpikeRule(on="loss", warmup=2))
    stepper = step._stepper  # its rule is set aside for the variants without it
    rule = stepper.watch.spikes

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    flops = count_flops(train, x, y, model=model)
    metered = speed_report(samples=len, flops=flops, every=100, file=None)(train)
    ckpt = Checkpointer(directory, model=model, step=step, preemption=False)
    ckpt.resume()  # an empty directory: a fresh run
    maybe_save = ckpt.maybe_save

    def spikes(enabled: bool) -> None:
        stepper.judge.settle()  # (a pending verdict is read with the rule it was made under)
        stepper.watch.spikes = rule if enabled else None

    def hand() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=on):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def saving() -> None:
        train(x, y)
        maybe_save()

    def everything() -> None:
        metered(x, y)
        maybe_save()

    calls: dict[str, tuple[bool, Step]] = {
        REFERENCE: (False, hand),
        BARE: (False, lambda: train(x, y)),
        FEATURES[0]: (False, lambda: metered(x, y)),
        FEATURES[1]: (True, lambda: train(x, y)),
        FEATURES[2]: (False, saving),
        ALL: (True, everything),
    }
    out: dict[str, Block] = {}
    for key, (enabled, fn) in calls.items():
        # A variant's block starts with the rule as it needs it (a call per block).
        out[key] = _with_rule(spikes, enabled, fn)
    inner: list[int] = []
    now = time.perf_counter_ns

    @functools.wraps(train)
    def timed(x: torch.Tensor, y: torch.Tensor) -> Any:
        t0 = now()
        result = train(x, y)
        inner.append(now() - t0)
        return result

    return Rig(out, train, timed, inner, flops, spikes, stepper, maybe_save, x, y)


#: A gap this long (ns) is the process descheduled by another tenant, not the work timed.
DESCHEDULED = 1_000_000


def _mean_below(gaps: Iterable[int]) -> float:
    """The mean of ``gaps`` under :data:`DESCHEDULED` (the meter's line and its batch
    work, tens of µs, stay in; a millisecond off the CPU does not)."""
    kept = [g for g in gaps if g < DESCHEDULED]
    return sum(kept) / max(1, len(kept))


def in_place(rig: Rig, blocks: int, calls: int = 1600) -> dict[str, float]:
    """Seconds each feature adds to a step, timed where it runs; and the step's own.

    Steadier than the side-by-side ratios, which a busy machine moves by a percent or
    two: ``maybe_save()`` timed alone after each step; the meter as a timer outside
    the metered call less one inside it (less the same for a plain function in its
    place, the timers' own cost), over blocks of 1,600 calls (whole numbers of the
    meter's batches of 64 and of its line's 100 steps); the spike rule as the end of a
    window (``finish``) with it less without it (``bench_loss_spikes.in_place``).
    Means per block, leaving out gaps of a millisecond or more (the process was
    descheduled), then medians over ``blocks`` blocks.
    """
    from bench_loss_spikes import in_place as rule_in_place

    now = time.perf_counter_ns
    timed, inner, x, y = rig.timed, rig.inner, rig.x, rig.y
    metered = speed_report(samples=len, flops=rig.flops, every=100, file=None)(timed)

    def passthrough(x: torch.Tensor, y: torch.Tensor) -> Any:
        return timed(x, y)

    rig.spikes(False)
    gaps: dict[Any, list[float]] = {metered: [], passthrough: []}
    saves: list[float] = []
    steps: list[float] = []
    for fn in gaps:
        for _ in range(calls):  # a whole block first: the meter's place in its cycles
            fn(x, y)
    gc.collect()
    gc.disable()
    try:
        for _ in range(blocks):
            for fn, means in gaps.items():
                inner.clear()
                outer = []
                for _ in range(calls):
                    t0 = now()
                    fn(x, y)
                    outer.append(now() - t0)
                means.append(_mean_below(a - b for a, b in zip(outer, inner, strict=True)))
                steps.append(statistics.median(inner))
            spent = []
            for _ in range(calls // 4):
                rig.train(x, y)
                t0 = now()
                rig.maybe_save()
                spent.append(now() - t0)
            saves.append(_mean_below(spent))
        rule = rule_in_place(rig.train, rig.stepper, x, y, max(2, calls // 400) * blocks)
    finally:
        gc.enable()
    meter = statistics.median(gaps[metered]) - statistics.median(gaps[passthrough])
    return {
        FEATURES[0]: meter / 1e9,
        FEATURES[1]: rule,
        FEATURES[2]: statistics.median(saves) / 1e9,
        "step": statistics.median(steps) / 1e9,
    }


def _with_rule(spikes: Callable[[bool], None], enabled: bool, fn: Step) -> Block:
    def block(n: int) -> None:
        spikes(enabled)
        for _ in range(n):
            fn()

    return block


def time_variants(
    blocks: dict[str, Block],
    rounds: int,
    reps: int,
    seconds: float,
    clock: Callable[[], float],
    sync: Callable[[], None],
) -> dict[str, list[float]]:
    """Seconds per step of each variant, one figure per round, the variants taking turns."""
    for block in blocks.values():  # warm up every variant (the rule's statistics too)
        block(10)
    sync()
    per = {}
    for key, block in blocks.items():
        t0 = clock()
        block(20)
        sync()
        per[key] = max((clock() - t0) / 20, 1e-7)
    sizes = {k: max(1, int(seconds / p)) for k, p in per.items()}
    keys = list(blocks)
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
                    n = sizes[key]
                    sync()
                    t0 = clock()
                    blocks[key](n)
                    sync()
                    totals[key] += (clock() - t0) / n
            for key in keys:
                times[key].append(totals[key] / reps)
    finally:
        gc.enable()
    return times


def run(
    args: argparse.Namespace, name: str, rounds: int, clock: Callable[[], float]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One precision: print its table; return its rows and its per-feature shares."""
    device = torch.device(args.device)
    dtype = DTYPES[name]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    support = capabilities(device) if dtype == torch.bfloat16 else "native"
    label = str(dtype).removeprefix("torch.") + ("" if support == "native" else f" ({support})")
    with tempfile.TemporaryDirectory() as directory:
        rig = variants(device, dtype, directory)
        times = time_variants(rig.blocks, rounds, 2 if args.quick else 6, args.block, clock, sync)
        placed = in_place(rig, 1 if args.quick else 5, args.calls)
    case = label  # (the step is the same for every case: the 64-wide MLP, batch 32)
    print(
        f"# torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, device {device}, threads {torch.get_num_threads()}, "
        f"{rounds} rounds, {args.clock} clock, {label}"
    )
    print(f"| variant | median per step | ratio to {REFERENCE} | ratio to {BARE} |")
    print("|---|---:|---:|---:|")
    rows, pairs = [], []
    for key, seconds in times.items():
        ratio = statistics.median(a / b for a, b in zip(seconds, times[REFERENCE], strict=True))
        own = statistics.median(a / b for a, b in zip(seconds, times[BARE], strict=True))
        med = statistics.median(seconds) * 1e6
        print(f"| {key} | {med:.1f} µs | {ratio:.3f} | {own:.3f} |")
        rows.append(
            {
                "case": case,
                "implementation": key,
                "time_us": round(med, 2),
                "ratio": round(ratio, 4),
            }
        )
        if key in (*FEATURES, ALL):
            pairs.append({"case": case, "mine": key, "theirs": BARE, "ratio": round(own, 4)})
    shares = ", ".join(f"{p['mine']} {100 * (p['ratio'] - 1):+.2f} %" for p in pairs)
    print(f"# side by side, each feature's share of the step ({BARE} alone = 0): {shares}")
    hand = statistics.median(times[REFERENCE])
    bare = statistics.median(a / b for a, b in zip(times[BARE], times[REFERENCE], strict=True))
    added = sum(placed[f] for f in FEATURES)
    cells = ", ".join(f"{f} {placed[f] * 1e6:.2f} µs ({placed[f] / hand:.2%})" for f in FEATURES)
    print(f"# in place, per step (share of the hand-written step): {cells}")
    print(
        f"# {BARE} alone {bare:.3f} of the hand-written step, plus the three in place: "
        f"{bare + added / hand:.3f}"
    )
    for f in FEATURES:
        pairs.append(
            {"case": case, "mine": f"{f} in place", "theirs": REFERENCE,
             "ratio": round(1 + placed[f] / hand, 4)}
        )  # fmt: skip
    return rows, pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        action="append",
        help="precision of the step; repeat for several (default: fp32 and bf16)",
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--block", type=float, default=0.02, help="seconds of steps per turn")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--calls", type=int, default=1600, help="calls per block of the in-place figures"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default=None,
        help="cpu: the process's CPU time (the default on the CPU); wall (on a GPU)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the data file")
    args = parser.parse_args(argv)
    if args.clock is None:
        args.clock = "cpu" if args.device == "cpu" else "wall"
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu measures host work only; use --clock wall with --device cuda")
    if not args.block > 0:
        parser.error("--block must be a positive number of seconds")
    if args.calls < 8:
        parser.error("--calls must be at least 8")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rounds = args.rounds or (3 if args.quick else 21)
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        load = _report.load_average()
        rows: list[dict[str, Any]] = []
        pairs: list[dict[str, Any]] = []
        for name in args.dtype or ["fp32", "bf16"]:
            more, shares = run(args, name, rounds, clock)
            rows += more
            pairs += shares
    finally:
        torch.set_num_threads(threads)
    if args.json is not None:
        settings = (
            f"device {args.device}, {args.threads} thread(s), {rounds} rounds, "
            f"blocks of {args.block} s, {args.clock} clock"
        )
        _report.write(args.json, figure_data(rows, pairs, settings, argv, load))


def figure_data(
    rows: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    settings: str,
    argv: list[str] | None,
    load: float,
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_watching.json."""
    return _report.record(
        "benchmarks/bench_watching.py",
        title="A watched run against the hand-written loop",
        settings=settings,
        argv=argv,
        load_before=load,
        reference=REFERENCE,
        group_by=["case"],
        ratio="median over rounds of the time per step divided by the hand-written loop's",
        pairs=pairs,
        rows=rows,
    )


if __name__ == "__main__":
    main()
