"""Benchmark ``cudakit.amp.autocast_step`` against the hand-written mixed-precision step.

Run ``python benchmarks/bench_autocast_step.py`` (``--quick`` for a smoke run,
``--device cuda`` on a GPU machine, where the hand-written loop uses the same
dtype ``autocast_step(dtype="auto")`` picks there, with a GradScaler for fp16).
Every implementation runs in a process of its own (each heap to itself, as in a real
training run: in one shared process, the allocator state the other implementations
left behind moved a 10 ms step by up to 10% between runs), built ``--sets`` times
(default 3: where a model's tensors land in memory moves one instance's time by up to
about 1.5% against an identical one, and the sum evens that out). One process at a
time times a short block of steps (``--block``, 20 ms) of each of its instances, taking
turns with the others several times a round, so a slow spell on a shared machine hits
them all alike; the table shows the median time per step and the median over rounds of
its ratio to the hand-written loop.
``--clock cpu`` times with the worker process's CPU time instead of the wall clock: on
the CPU all the work runs in it, so time spent descheduled by other tenants of a
shared machine no longer counts (cache contention still does).
``--malloc fixed`` fixes glibc's mmap and trim thresholds in every worker: a process's
allocator history then no longer moves the 1024-wide case from run to run.

Implementations: the hand-written loop (autocast, backward, ``opt.step()``,
``opt.zero_grad()``); the same with the guard written by hand (one fused inf/NaN
check, a read of the flag, the step only when it is clean); ``@autocast_step(opt)``
with the default non-finite guard;
the explicit form (``with step:`` + ``step.backward(loss)``); the decorator with
``skip_nonfinite=False``; and, when importable, accelerate
(``Accelerator(mixed_precision="bf16")``) and lightning-fabric
(``Fabric(precision="bf16-mixed")``) doing the same step in the same precision
(lightning-fabric is left out of fp16 on the CPU, where it runs bf16 instead).

Cases: an MLP 64 wide (batch 32) and one 1024 wide (batch 256), AdamW.

``--compile`` compares, side by side in one run, on an MLP 4x128 with GELU and
LayerNorm (batch 32) and fused AdamW: the hand-written eager step, the same with the
guard written by hand (skipping on the device through ``found_inf``, or on the host),
cudakit eager (sync-free guard), a hand-written compiled step (``torch.compile`` over
the forward and loss; backward through the compiled graph; the fused optimizer step),
the same with either hand-written guard, and ``autocast_step(..., compile=True)``.
``--dtype`` picks the precision of every implementation (default bf16; ``auto`` is what
``autocast_step`` picks here).

``--json PATH`` also writes the figures, the machine and the date as a data file of
``docs/figures/`` (``bench_autocast_step.json``, and ``bench_autocast_step_compile.json``
for ``--compile``): ``python scripts/make_figures.py`` redraws the chart from it and
``python scripts/bench_tables.py`` the table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
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
    from cudakit.amp import autocast_step
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cudakit.amp import autocast_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report

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


def peer_step(model: Any, backward: Callable[[torch.Tensor], Any], opt: Any) -> Step:
    """A peer's step: its own ``backward`` (accelerate's, Fabric's), then step and zero_grad."""

    def step(x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.cross_entropy(model(x), y)
        backward(loss)
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


def make_steps(
    width: int, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable[[], Step]]:
    """A builder for every implementation: each call makes one fresh instance."""
    dev_type = device.type
    on = dtype != torch.float32

    def hand() -> Step:
        model = mlp(width, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(dev_type) if dtype == torch.float16 else None

        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(dev_type, dtype=dtype, enabled=on):
                return F.cross_entropy(model(x), y)

        return hand_written(forward, opt, scaler)

    def decorated(**options: Any) -> Step:
        model = mlp(width, device)

        @autocast_step(torch.optim.AdamW(model.parameters(), lr=1e-4), dtype=dtype, **options)
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        return step

    def explicit() -> Step:
        model = mlp(width, device)
        s = autocast_step(torch.optim.AdamW(model.parameters(), lr=1e-4), dtype=dtype)

        def step(x: torch.Tensor, y: torch.Tensor) -> Any:
            with s:
                loss = F.cross_entropy(model(x), y)
            return s.backward(loss)

        return step

    # The peers' names for the same precision.
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")
    fabric_precision = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(
        dtype, "32-true"
    )

    def accelerate() -> Step:
        from accelerate import Accelerator

        acc = Accelerator(mixed_precision=precision, cpu=dev_type == "cpu")
        model = mlp(width, device)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return peer_step(model, acc.backward, opt)

    def fabric() -> Step:
        from lightning_fabric import Fabric

        accelerator = "cuda" if dev_type == "cuda" else "cpu"
        f = Fabric(accelerator=accelerator, devices=1, precision=fabric_precision)
        model = mlp(width, device)
        model, opt = f.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        return peer_step(model, f.backward, opt)

    steps: dict[str, Callable[[], Step]] = {"hand-written": hand}
    if dtype != torch.float16:  # fp16's scaler already checks; this is the bf16/fp32 guard
        steps["hand-written + guard"] = lambda: guarded_hand(mlp(width, device), dtype, on="host")
    steps["cudakit @autocast_step"] = decorated
    steps["cudakit explicit form"] = explicit
    steps["cudakit, guard off"] = lambda: decorated(skip_nonfinite=False)
    if importlib.util.find_spec("accelerate") is not None:
        steps["accelerate"] = accelerate
    # lightning-fabric runs "16-mixed" as bf16 on the CPU (with a warning): not the same step.
    fp16_on_cpu = dtype == torch.float16 and dev_type == "cpu"
    if importlib.util.find_spec("lightning_fabric") is not None and not fp16_on_cpu:
        steps["lightning-fabric"] = fabric
    return steps


def mlp_ln(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, 128), torch.nn.GELU()]
    for _ in range(3):
        layers += [torch.nn.LayerNorm(128), torch.nn.Linear(128, 128), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(128, 10)).to(device)


def make_compile_steps(device: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], Step]]:
    """Builders of eager and compiled, hand-written and cudakit steps, all with fused AdamW."""
    dev_type = device.type
    on = dtype != torch.float32

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

    steps: dict[str, Callable[[], Step]] = {"hand-written": lambda: hand_step(False)}
    if dtype != torch.float16:
        steps["hand-written + guard on device"] = lambda: guarded_hand_step(False, "device")
        steps["hand-written + guard on host"] = lambda: guarded_hand_step(False, "host")
    steps["cudakit @autocast_step (sync-free)"] = lambda: cudakit_step(False)
    steps["hand-written, compiled"] = lambda: hand_step(True)
    if dtype != torch.float16:
        steps["hand-written, compiled + guard on device"] = lambda: guarded_hand_step(
            True, "device"
        )
        steps["hand-written, compiled + guard on host"] = lambda: guarded_hand_step(True, "host")
    steps["cudakit compile=True"] = lambda: cudakit_step(True)
    return steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Spec(NamedTuple):
    """What a worker builds and how it times: one implementation of one case."""

    key: str
    compile: bool
    width: int
    batch: int
    device: str
    dtype: str
    threads: int
    sets: int
    clock: str


def worker(conn: Any, spec: Spec) -> None:
    """One implementation in a process of its own: build ``spec.sets`` instances, then time
    ``n`` steps of each whenever the coordinator sends ``n`` (None ends it)."""
    try:
        torch.set_num_threads(spec.threads)
        device = torch.device(spec.device)
        dtype = getattr(torch, spec.dtype)
        table = (
            make_compile_steps(device, dtype)
            if spec.compile
            else make_steps(spec.width, device, dtype)
        )
        fns = [table[spec.key]() for _ in range(spec.sets)]
        del table
        gen = torch.Generator().manual_seed(1234)  # the same batch in every worker
        x = torch.randn(spec.batch, 64, generator=gen).to(device)  # every model takes 64
        y = torch.randint(0, 10, (spec.batch,), generator=gen).to(device)
        for fn in fns:
            for _ in range(5):
                fn(x, y)
        sync(device)
    except Exception as e:  # the coordinator decides: a peer is skipped, else it stops
        conn.send(("error", f"{type(e).__name__}: {e}"[:300]))
        return
    conn.send(("ready", ""))
    clock = time.process_time if spec.clock == "cpu" else time.perf_counter
    gc.collect()
    gc.disable()
    while (n := conn.recv()) is not None:
        total = 0.0
        for fn in fns:
            sync(device)
            t0 = clock()
            for _ in range(n):
                fn(x, y)
            sync(device)
            total += clock() - t0
        conn.send(total / (n * len(fns)))


#: glibc's allocator with its mmap and trim thresholds fixed: large tensors come from the
#: heap, which is never trimmed, whatever the process allocated before.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


class Workers:
    """A process per implementation, started together, each asked in turn to time steps."""

    def __init__(self, specs: list[Spec], env: dict[str, str], optional: set[str]) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork after CUDA or OpenMP start
        self.procs: dict[str, tuple[Any, Any]] = {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # read by each worker's C library when it starts
        try:
            for spec in specs:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker, args=(child, spec), daemon=True)
                proc.start()
                child.close()  # the worker's end: its exit then ends the pipe here too
                self.procs[spec.key] = (proc, parent)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            for key in list(self.procs):
                status, message = self._started(key)
                if status == "ready":
                    continue
                if key not in optional:
                    raise RuntimeError(f"bench worker {key!r} failed: {message}")
                print(f"# {key} skipped: {message}", file=sys.stderr)
                proc, conn = self.procs.pop(key)
                conn.close()
                proc.join(10)
        except BaseException:
            self.close()
            raise

    def _started(self, key: str) -> tuple[str, str]:
        """The worker's first message, or why it never came (it died, or took 900 s)."""
        proc, conn = self.procs[key]
        if not multiprocessing.connection.wait([conn, proc.sentinel], timeout=900):
            return "error", "did not start within 900 s"
        try:
            status, message = conn.recv()
        except EOFError:
            proc.join(10)
            return "error", f"exited with code {proc.exitcode} while starting"
        return str(status), str(message)

    def keys(self) -> list[str]:
        return list(self.procs)

    def time(self, key: str, n: int) -> float:
        """Mean seconds per step over ``n`` steps of each of ``key``'s instances."""
        proc, conn = self.procs[key]
        conn.send(n)
        try:
            return float(conn.recv())
        except EOFError:
            proc.join(10)
            raise RuntimeError(
                f"bench worker {key!r} exited with code {proc.exitcode} while timing"
            ) from None

    def close(self) -> None:
        for _, conn in self.procs.values():
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc, conn in self.procs.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
            conn.close()


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
        "--block",
        type=float,
        default=0.02,
        help="seconds of steps timed in one go before the next implementation's turn",
    )
    parser.add_argument(
        "--malloc",
        choices=("default", "fixed"),
        default="default",
        help="fixed: glibc's mmap and trim thresholds fixed in every worker (32 MiB, never "
        "trim), so runs agree; default: each process's own allocator, as in training",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: least noise on shared CPUs)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall (default) or cpu: the worker process's CPU time, for shared CPU machines",
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
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the data file")
    args = parser.parse_args(argv)
    load = _report.load_average()
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu measures host work only; use the wall clock with --device cuda")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rounds = args.rounds or (3 if args.quick else 21)
    if args.sets < 1:
        parser.error("--sets must be at least 1")
    if not args.block > 0:
        parser.error("--block must be a positive number of seconds")
    dtype = resolve_dtype(args.dtype, device)
    cases = [("MLP 64 wide, batch 32", 64, 32), ("MLP 1024 wide, batch 256", 1024, 256)]
    if args.compile:
        cases = [("MLP 4x128 GELU+LayerNorm, batch 32", 128, 32)]

    print(
        f"# torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, device {device}, threads {torch.get_num_threads()}, "
        f"{rounds} rounds, {args.sets} sets, {args.clock} clock, malloc {args.malloc}, "
        f"{str(dtype).removeprefix('torch.')}"
    )
    header = "| case | implementation | median per step | ratio to hand-written |"
    print(header)
    print("|---|---|---:|---:|")
    rows: list[dict[str, Any]] = []
    compared: list[dict[str, Any]] = []
    for name, width, batch in cases:
        kinds = (
            make_compile_steps(device, dtype) if args.compile else make_steps(width, device, dtype)
        )
        specs = [
            Spec(
                key,
                args.compile,
                width,
                batch,
                args.device,
                str(dtype).removeprefix("torch."),
                args.threads,
                args.sets,
                args.clock,
            )
            for key in kinds
        ]
        del kinds
        workers = Workers(
            specs,
            FIXED_MALLOC if args.malloc == "fixed" else {},
            {"accelerate", "lightning-fabric"},
        )
        try:
            steps = workers.keys()
            target = 0.02 if args.quick else 0.25  # seconds per implementation per round
            per = workers.time("hand-written", max(1, 20 // args.sets))
            # Short blocks of steps, taken in turn from every implementation several
            # times a round: a slow spell on a shared machine then hits them all alike.
            block = max(1, int(args.block / per / args.sets))
            reps = max(1, int(target / per / args.sets / block))
            times: dict[str, list[float]] = {k: [] for k in steps}
            ratios: dict[str, list[float]] = {k: [] for k in steps}
            for _ in range(rounds):
                totals = dict.fromkeys(steps, 0.0)
                for rep in range(reps):
                    # A different implementation goes first each time: whatever a switch
                    # between processes costs falls on all of them alike.
                    shift = rep % len(steps)
                    for key in steps[shift:] + steps[:shift]:
                        totals[key] += workers.time(key, block)
                for key in steps:
                    times[key].append(totals[key] / reps)
                    ratios[key].append(totals[key] / totals["hand-written"])
        finally:
            workers.close()
        for key in steps:
            med = statistics.median(times[key]) * 1e6
            ratio = statistics.median(ratios[key])
            print(f"| {name} | {key} | {med:.1f} µs | {ratio:.3f} |")
            rows.append(
                {
                    "case": name,
                    "implementation": key,
                    "time_us": round(med, 1),
                    "ratio": round(ratio, 4),
                }
            )
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
                ratio = statistics.median(per_round)
                print(f"# {mine} / {theirs}: {ratio:.3f}")
                compared.append(
                    {"case": name, "mine": mine, "theirs": theirs, "ratio": round(ratio, 4)}
                )
    if args.json:
        settings = (
            f"device {device}, {str(dtype).removeprefix('torch.')}, {args.threads} thread(s), "
            f"a process per implementation, {args.sets} sets, {rounds} rounds, "
            f"{args.clock} clock, malloc {args.malloc}"
        )
        data = figure_data(rows, compared, settings, args.compile, argv, load)
        _report.write(args.json, data)


def figure_data(
    rows: list[dict[str, Any]],
    pairs: list[dict[str, Any]],
    settings: str,
    compiled: bool,
    argv: list[str] | None,
    load: float,
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_autocast_step.json (with
    ``compiled``, ``--compile``'s: bench_autocast_step_compile.json)."""
    title = (
        "autocast_step, eager and compiled, against the hand-written eager step"
        if compiled
        else "autocast_step and its peers, time per step against the hand-written step"
    )
    return _report.record(
        "benchmarks/bench_autocast_step.py",
        title=title,
        settings=settings,
        argv=argv,
        load_before=load,
        peers=("accelerate", "lightning-fabric"),
        reference="hand-written",
        group_by=["case"],
        ratio="median over rounds of each round's time divided by the reference's",
        pairs=pairs,
        rows=rows,
    )


if __name__ == "__main__":
    main()
