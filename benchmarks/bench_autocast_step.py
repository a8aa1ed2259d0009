"""Benchmark ``cudakit.amp.autocast_step`` against the hand-written bf16 training step.

Run ``python benchmarks/bench_autocast_step.py`` (``--quick`` for a smoke run,
``--device cuda`` on a GPU machine, where the hand-written loop uses the same
dtype ``autocast_step(dtype="auto")`` picks there, with a GradScaler for fp16).
One process; every round times each implementation on each case in turn
(interleaved, so drift hits all of them alike); the table shows the median time
per step and the median over rounds of its ratio to the hand-written loop. Each
implementation is built ``--sets`` times (default 3) and every round times all its
instances: where a model's tensors land in memory moves one instance's time by up to
about 1.5% against an identical one, and the sum evens that out.
``--clock cpu`` times with this thread's CPU time instead of the wall clock: with
one torch thread on CPU all the work runs on it, so time spent descheduled by
other tenants of a shared machine no longer counts (cache contention still does).

Implementations: the hand-written loop (autocast, backward, ``opt.step()``,
``opt.zero_grad()``); the same with the guard written by hand (one fused inf/NaN
check, a read of the flag, the step only when it is clean); ``@autocast_step(opt)``
with the default non-finite guard;
the explicit form (``with step:`` + ``step.backward(loss)``); the decorator with
``skip_nonfinite=False``; and, when importable, accelerate
(``Accelerator(mixed_precision="bf16")``) and lightning-fabric
(``Fabric(precision="bf16-mixed")``) doing the same step.

Cases: an MLP 64 wide (batch 32) and one 1024 wide (batch 256), AdamW.

``--compile`` compares, side by side in one run, on an MLP 4x128 with GELU and
LayerNorm (batch 32) and fused AdamW: the hand-written eager step, the same with the
guard written by hand (skipping on the device through ``found_inf``, or on the host),
cudakit eager (sync-free guard), a hand-written compiled step (``torch.compile`` over
the forward and loss; backward through the compiled graph; the fused optimizer step),
the same with either hand-written guard, and ``autocast_step(..., compile=True)``.
``--dtype`` picks the precision of every implementation (default bf16; ``auto`` is what
``autocast_step`` picks here).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

try:
    from cudakit.amp import autocast_step
except ImportError:  # run from a checkout without installing
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cudakit.amp import autocast_step

Step = Callable[[torch.Tensor, torch.Tensor], Any]


def mlp(width: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    ).to(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    probe = autocast_step(torch.optim.SGD(mlp(8, device).parameters(), lr=0.1))
    return probe.dtype  # the dtype autocast_step picks here


def hand_written(forward: Step, opt: Any, scaler: torch.amp.GradScaler | None) -> Step:
    """The hand-written loop: forward (autocast inside), backward, step, ``zero_grad``."""

    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = forward(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        return loss

    return step


def guarded_hand(
    model: torch.nn.Module,
    dtype: torch.dtype,
    *,
    on: str,
    forward: Step | None = None,
    opt: Any = None,
) -> Step:
    """The hand-written loop plus the guard autocast_step runs, written by hand.

    One fused inf/NaN check over the loss and every gradient, then either a read of
    the flag and ``opt.step()`` only when it is clean (``on="host"``: what cudakit does
    on the CPU and with optimizers that cannot skip on the device) or the flag handed to
    a fused optimizer as ``found_inf`` (``on="device"``: what GradScaler does, and
    cudakit's sync-free path on a GPU).
    """
    on_ = dtype != torch.float32
    opt = opt if opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    device = params[0].device
    dev_type = device.type
    flag, one = torch.zeros(1, device=device), torch.ones(1, device=device)

    def fwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev_type, dtype=dtype, enabled=on_):
            return F.cross_entropy(model(x), y)

    forward = forward or fwd

    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        opt.zero_grad()
        loss = forward(x, y)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_([loss.detach(), *grads], flag, one)
        if on == "host":
            if flag.item():
                flag.zero_()
            else:
                opt.step()
            return loss
        opt.found_inf, opt.grad_scale = flag.clone().reshape(()), None
        flag.zero_()
        opt.step()
        del opt.found_inf, opt.grad_scale
        return loss

    return step


def make_steps(width: int, device: torch.device, dtype: torch.dtype) -> dict[str, Step]:
    dev_type = device.type
    steps: dict[str, Step] = {}
    on = dtype != torch.float32

    model = mlp(width, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(dev_type) if dtype == torch.float16 else None

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev_type, dtype=dtype, enabled=on):
            return F.cross_entropy(model(x), y)

    steps["hand-written"] = hand_written(forward, opt, scaler)
    if dtype != torch.float16:  # fp16's scaler already checks; this is the bf16/fp32 guard
        steps["hand-written + guard"] = guarded_hand(mlp(width, device), dtype, on="host")

    m2 = mlp(width, device)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-4)

    @autocast_step(o2, dtype=dtype)
    def decorated(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m2(x), y)

    steps["cudakit @autocast_step"] = decorated

    m3 = mlp(width, device)
    o3 = torch.optim.AdamW(m3.parameters(), lr=1e-4)
    s3 = autocast_step(o3, dtype=dtype)

    def explicit(x: torch.Tensor, y: torch.Tensor) -> Any:
        with s3:
            loss = F.cross_entropy(m3(x), y)
        return s3.backward(loss)

    steps["cudakit explicit form"] = explicit

    m4 = mlp(width, device)
    o4 = torch.optim.AdamW(m4.parameters(), lr=1e-4)

    @autocast_step(o4, dtype=dtype, skip_nonfinite=False)
    def unguarded(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m4(x), y)

    steps["cudakit, guard off"] = unguarded

    precision = "bf16" if dtype == torch.bfloat16 else "fp16"
    try:
        from accelerate import Accelerator

        acc = Accelerator(mixed_precision=precision, cpu=dev_type == "cpu")
        m5 = mlp(width, device)
        m5, o5 = acc.prepare(m5, torch.optim.AdamW(m5.parameters(), lr=1e-4))

        def accelerate_step(x: torch.Tensor, y: torch.Tensor) -> Any:
            loss = F.cross_entropy(m5(x), y)
            acc.backward(loss)
            o5.step()
            o5.zero_grad()
            return loss

        steps["accelerate"] = accelerate_step
    except Exception as e:  # not installed, or broken against this torch
        print(f"# accelerate skipped: {type(e).__name__}: {e}"[:200], file=sys.stderr)
    try:
        from lightning_fabric import Fabric

        fabric = Fabric(
            accelerator="cuda" if dev_type == "cuda" else "cpu",
            devices=1,
            precision=f"{precision}-mixed",
        )
        m6 = mlp(width, device)
        m6, o6 = fabric.setup(m6, torch.optim.AdamW(m6.parameters(), lr=1e-4))

        def fabric_step(x: torch.Tensor, y: torch.Tensor) -> Any:
            loss = F.cross_entropy(m6(x), y)
            fabric.backward(loss)
            o6.step()
            o6.zero_grad()
            return loss

        steps["lightning-fabric"] = fabric_step
    except Exception as e:
        print(f"# lightning-fabric skipped: {type(e).__name__}: {e}"[:200], file=sys.stderr)
    return steps


def mlp_ln(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, 128), torch.nn.GELU()]
    for _ in range(3):
        layers += [torch.nn.LayerNorm(128), torch.nn.Linear(128, 128), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(128, 10)).to(device)


def make_compile_steps(device: torch.device, dtype: torch.dtype) -> dict[str, Step]:
    """Eager and compiled, hand-written and cudakit, all with fused AdamW."""
    dev_type = device.type
    on = dtype != torch.float32
    steps: dict[str, Step] = {}

    def fused(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def model_and_forward(compiled: bool) -> tuple[torch.nn.Module, Step]:
        model = mlp_ln(device)

        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(dev_type, dtype=dtype, enabled=on):
                return F.cross_entropy(model(x), y)

        return model, torch.compile(forward) if compiled else forward

    def hand_step(compiled: bool) -> Step:
        model, fwd = model_and_forward(compiled)
        opt = fused(model)
        scaler = torch.amp.GradScaler(dev_type) if dtype == torch.float16 else None
        return hand_written(fwd, opt, scaler)

    def cudakit_step(compiled: bool) -> Step:
        model = mlp_ln(device)

        @autocast_step(fused(model), dtype=dtype, compile=compiled)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        return step

    def guarded_hand_step(compiled: bool, on: str) -> Step:
        model, fwd = model_and_forward(compiled)
        return guarded_hand(model, dtype, on=on, forward=fwd, opt=fused(model))

    steps["hand-written"] = hand_step(False)
    if dtype != torch.float16:
        steps["hand-written + guard on device"] = guarded_hand_step(False, "device")
        steps["hand-written + guard on host"] = guarded_hand_step(False, "host")
    steps["cudakit @autocast_step (sync-free)"] = cudakit_step(False)
    steps["hand-written, compiled"] = hand_step(True)
    if dtype != torch.float16:
        steps["hand-written, compiled + guard on device"] = guarded_hand_step(True, "device")
        steps["hand-written, compiled + guard on host"] = guarded_hand_step(True, "host")
    steps["cudakit compile=True"] = cudakit_step(True)
    return steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--sets",
        type=int,
        default=3,
        help="independent instances of every implementation, timed in turn (default 3)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: least noise on shared CPUs)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall (default) or cpu: this thread's CPU time, for shared CPU machines",
    )
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32", "auto"),
        default="bf16",
        help="precision of every implementation (auto: what autocast_step picks here)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="eager and compiled steps (hand-written and cudakit) with fused AdamW",
    )
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu measures host work only; use the wall clock with --device cuda")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rounds = args.rounds or (3 if args.quick else 21)
    if args.sets < 1:
        parser.error("--sets must be at least 1")
    dtype = resolve_dtype(args.dtype, device)
    cases = [("MLP 64 wide, batch 32", 64, 32), ("MLP 1024 wide, batch 256", 1024, 256)]
    if args.compile:
        cases = [("MLP 4x128 GELU+LayerNorm, batch 32", 128, 32)]

    print(
        f"# torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, device {device}, threads {torch.get_num_threads()}, "
        f"{rounds} rounds, {args.sets} sets, {args.clock} clock, "
        f"{str(dtype).removeprefix('torch.')}"
    )
    header = "| case | implementation | median per step | ratio to hand-written |"
    print(header)
    print("|---|---|---:|---:|")
    for name, width, batch in cases:
        # Several independent sets of every implementation: where a model's tensors land
        # in memory moves one instance's time by up to about 1.5% against an identical
        # one, so each round times every instance and compares the sums.
        sets = [
            make_compile_steps(device, dtype) if args.compile else make_steps(width, device, dtype)
            for _ in range(args.sets)
        ]
        steps = sets[0]
        x = torch.randn(batch, 64, device=device)  # every model takes 64 features
        y = torch.randint(0, 10, (batch,), device=device)
        target = 0.02 if args.quick else 0.25  # seconds per implementation per round
        # Calibrate the number of steps per timing on the hand-written loop (warms all up).
        for one in sets:
            for fn in one.values():
                for _ in range(5):
                    fn(x, y)
        sync(device)
        t0 = clock()
        for _ in range(20):
            steps["hand-written"](x, y)
        sync(device)
        per = (clock() - t0) / 20
        n = max(5, int(target / per / len(sets)))
        times: dict[str, list[float]] = {k: [] for k in steps}
        ratios: dict[str, list[float]] = {k: [] for k in steps}
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for _ in range(rounds):
                this: dict[str, float] = {}
                for key in steps:
                    total = 0.0
                    for one in sets:
                        fn = one[key]
                        sync(device)
                        t0 = clock()
                        for _ in range(n):
                            fn(x, y)
                        sync(device)
                        total += clock() - t0
                    this[key] = total / (n * len(sets))
                    times[key].append(this[key])
                for key in steps:
                    ratios[key].append(this[key] / this["hand-written"])
        finally:
            if gc_was:
                gc.enable()
        for key in steps:
            med = statistics.median(times[key]) * 1e6
            print(f"| {name} | {key} | {med:.1f} µs | {statistics.median(ratios[key]):.3f} |")
        pairs = [
            ("cudakit @autocast_step", "hand-written + guard"),
            ("cudakit compile=True", "hand-written, compiled"),
            ("cudakit compile=True", "hand-written, compiled + guard on device"),
            ("cudakit compile=True", "hand-written, compiled + guard on host"),
            ("cudakit @autocast_step (sync-free)", "hand-written + guard on device"),
            ("cudakit @autocast_step (sync-free)", "hand-written + guard on host"),
        ]
        for mine, theirs in pairs:
            if mine in steps and theirs in steps:
                per_round = [a / b for a, b in zip(times[mine], times[theirs], strict=True)]
                print(f"# {mine} / {theirs}: {statistics.median(per_round):.3f}")
        with contextlib.suppress(Exception):
            del steps, sets


if __name__ == "__main__":
    main()
