"""estimate_memory against each rank's measured peak, per world size, strategy and policy.

Run ``python benchmarks/bench_estimate.py`` (``--quick`` for world sizes 1 and 2 and
fewer cells). One ``cudakit.parallel.launch`` per world size (gloo ranks on the CPU)
trains a small stack of transformer-like MLP blocks for two AdamW steps in every
cell: world 1 without a strategy, 2 and 4 ranks under DDP and FSDP2; each with no
recompute, ``"full"`` and ``"selective"``; in fp32 and under bf16 autocast. The
measured peak is the most live tensor bytes any rank held (torch's ``MemTracker``);
``estimate_memory``'s prediction of it is given as a ratio (goal: within 10 % in
every cell), and beside it accelerate's estimate where accelerate is installed: what
``accelerate estimate-memory`` prints as "Training using Adam" for the same model
(``calculate_maximum_sizes`` and ``estimate_training_usage``; one model, not a rank,
and no activations).

``--json PATH`` also writes the figures, the machine and the date as the data file of
``docs/figures/bench_estimate.json`` (table of docs/benchmarks.md:
``scripts/bench_tables.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report

import cudakit.parallel as cp
from cudakit.memory import estimate_memory

#: (world size, strategy, recompute policy, precision): the cells of one run.
Cell = tuple[int, str, str | None, str]

POLICIES: tuple[str | None, ...] = (None, "full", "selective")
PRECISIONS = ("fp32", "bf16")
TOLERANCE = 0.10


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def cells(
    worlds: Sequence[int], policies: Sequence[str | None], precisions: Sequence[str]
) -> list[Cell]:
    """Every cell of the run: world 1 without a strategy, the others DDP and FSDP2."""
    return [
        (world, strategy, policy, precision)
        for world in worlds
        for strategy in (("none",) if world == 1 else ("ddp", "fsdp"))
        for policy in policies
        for precision in precisions
    ]


def measure(model: nn.Module, shape: tuple[int, ...], cell: Cell) -> int:
    """The real peak of live tensor bytes over two AdamW steps, as torch's MemTracker sees it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    _, strategy, policy, precision = cell
    tracker = MemTracker()
    peak = 0
    dtype = {"bf16": torch.bfloat16}.get(precision)
    with tracker:
        net = cp.parallelize(model, strategy, device="cpu", recompute=policy)
        opt = torch.optim.AdamW(net.parameters())
        x = torch.randn(shape)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            cast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
            with cast:
                loss = net(x).sum()
            loss.backward()
            del loss
            opt.step()
            peak = max(peak, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            tracker.reset_mod_stats()
    return int(peak)


def rank_body(run: list[Cell], depth: int, width: int, shape: tuple[int, ...]) -> list[int]:
    """One rank of one world size: its peak in each of ``run``'s cells, in order."""
    torch.set_num_threads(1)  # the ranks share a few cores
    # FSDP2 warns of the view its root returns; the loss is summed, never changed in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    peaks = []
    for cell in run:
        torch.manual_seed(0)
        peaks.append(measure(Net(depth, width), shape, cell))
    return peaks


def estimate(depth: int, width: int, shape: tuple[int, ...], cell: Cell) -> int:
    """``estimate_memory``'s peak per rank for ``cell``, on a model built on meta."""
    world, strategy, policy, precision = cell
    with torch.device("meta"):
        model = Net(depth, width)
    batch = torch.empty(shape, device="meta")
    e = estimate_memory(
        model, batch, strategy=strategy, world_size=world, recompute=policy, precision=precision
    )
    return int(e.peak)


def accelerate_estimate(depth: int, width: int, precision: str) -> int | None:
    """What ``accelerate estimate-memory`` prints as "Training using Adam" for this model
    (the largest of its model, gradients, optimizer and step figures), or None without
    accelerate."""
    try:
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:
        return None
    with torch.device("meta"):
        model = Net(depth, width)
    total, _ = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total, {"fp32": "float32", "bf16": "bfloat16"}[precision])
    return int(max(usage.values()))


def deepspeed_estimate(depth: int, width: int, strategy: str, world: int) -> int | None:
    """What DeepSpeed's estimators give per GPU for this model's states (parameters,
    gradients, optimizer; mixed precision, nothing offloaded), or None without DeepSpeed:
    ZeRO-3's for FSDP2, ZeRO-2's on one GPU (nothing sharded) for one process and DDP."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return None
    with torch.device("meta"):
        model = Net(depth, width)
    total = sum(p.numel() for p in model.parameters())
    if strategy == "fsdp":
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        return estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=world, cpu_offload=False, cpu_offload_params=False
        )[1]
    return estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=1, cpu_offload=False)[1]


def _label(cell: Cell) -> str:
    world, strategy, policy, precision = cell
    return f"{world}, {strategy}, {policy or 'none'}, {precision}"


def figure_data(
    table: list[dict[str, Any]],
    settings: str,
    argv: Sequence[str] | None,
    load_before: float | None,
    peers: Sequence[str] = ("accelerate", "deepspeed"),
) -> dict[str, Any]:
    """The data file of a run: the chart's rows (each estimate / measured per cell), the table."""
    chart = [
        {"group": r["cell"], "series": name, "value": r[key]}
        for r in table
        for name, key in (
            ("accelerate", "accelerate_ratio"),
            ("DeepSpeed", "deepspeed_ratio"),
            ("cudakit", "ratio"),
        )
        if r.get(key) is not None
    ]
    return _report.record(
        "benchmarks/bench_estimate.py",
        title="estimated peak per rank / measured peak (max over ranks), on a CPU",
        settings=settings,
        rows=chart,
        argv=argv,
        load_before=load_before,
        peers=peers,
        unit="estimate / measured peak",
        goal={"value": 1.0, "label": "measured"},
        tolerance=TOLERANCE,
        table=table,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="world sizes 1 and 2, fewer cells")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--json", default=None, help="write the data file here")
    args = parser.parse_args(argv)
    load = _report.load_average()
    if args.quick:
        depth, width, shape = 3, 64, (4, 32, 64)
        run = cells((1, 2), (None, "full"), PRECISIONS)
    else:
        depth, width, shape = 4, 128, (4, 64, 128)
        run = cells((1, 2, 4), POLICIES, PRECISIONS)
    measured: dict[Cell, list[int]] = {}
    started = time.perf_counter()
    for world in dict.fromkeys(c[0] for c in run):
        mine = [c for c in run if c[0] == world]
        t0 = time.perf_counter()
        ranks = cp.launch(rank_body, mine, depth, width, shape, nprocs=world, timeout=args.timeout)
        print(f"# world {world}: {len(mine)} cells in {time.perf_counter() - t0:.0f} s")
        for i, cell in enumerate(mine):
            measured[cell] = [peaks[i] for peaks in ranks]
    theirs = {p: accelerate_estimate(depth, width, p) for p in PRECISIONS}
    table: list[dict[str, Any]] = []
    for cell in run:
        peak = max(measured[cell])
        mine_est = estimate(depth, width, shape, cell)
        other = theirs[cell[3]]
        ds = deepspeed_estimate(depth, width, cell[1], cell[0])
        table.append(
            {
                "cell": _label(cell),
                "world": cell[0],
                "strategy": cell[1],
                "recompute": cell[2] or "none",
                "precision": cell[3],
                "measured_kib": round(peak / 2**10, 1),
                "ranks_kib": [round(p / 2**10, 1) for p in measured[cell]],
                "estimate_kib": round(mine_est / 2**10, 1),
                "ratio": round(mine_est / peak, 3),
                "accelerate_kib": None if other is None else round(other / 2**10, 1),
                "accelerate_ratio": None if other is None else round(other / peak, 3),
                "deepspeed_kib": None if ds is None else round(ds / 2**10, 1),
                "deepspeed_ratio": None if ds is None else round(ds / peak, 3),
            }
        )
    print(
        f"# {depth} blocks of width {width}, batch {list(shape)} per rank, AdamW, "
        f"two steps per cell; {time.perf_counter() - started:.0f} s in all"
    )
    head = f"{'world, strategy, recompute, precision':<40}{'meas KiB':>10}{'est KiB':>10}"
    head += f"{'est/meas':>10}"
    if theirs["fp32"] is not None:
        head += f"{'accel/meas':>12}"
    if table and table[0]["deepspeed_ratio"] is not None:
        head += f"{'ds/meas':>10}"
    print(head)
    for r in table:
        line = f"{r['cell']:<40}{r['measured_kib']:>10.1f}{r['estimate_kib']:>10.1f}"
        line += f"{r['ratio']:>10.3f}"
        if r["accelerate_ratio"] is not None:
            line += f"{r['accelerate_ratio']:>12.3f}"
        if r["deepspeed_ratio"] is not None:
            line += f"{r['deepspeed_ratio']:>10.3f}"
        print(line)
    worst = max(abs(r["ratio"] - 1) for r in table)
    within = sum(abs(r["ratio"] - 1) <= TOLERANCE for r in table)
    print(
        f"# estimate within {TOLERANCE * 100:.0f} % of the measured peak in {within} of "
        f"{len(table)} cells; furthest {worst * 100:.1f} % off"
    )
    if args.json:
        settings = (
            f"{depth} blocks of width {width}, batch {list(shape)} per rank, AdamW, two "
            "steps per cell on gloo ranks, one thread each; peak of live tensor bytes "
            "(torch's MemTracker), the largest over the ranks"
        )
        _report.write(args.json, figure_data(table, settings, argv, load))


if __name__ == "__main__":
    main()
