"""Activation recompute: step time and peak memory per policy, and the estimate beside it.

Run ``python benchmarks/bench_recompute.py`` (``--quick`` for a smoke run). One
process trains a stack of transformer-like MLP blocks with AdamW on the CPU; each
policy runs as ``cudakit.parallel.recompute`` applies it and as torch's
``checkpoint_wrapper`` applied by hand with the same policy (goal: time at most
1.02x the hand-applied one). The variants run in interleaved rounds; the table
shows the median step time, the peak of live tensor bytes over two steps (torch's
``MemTracker``), both as ratios to no recompute, and ``estimate_memory``'s
prediction of that peak as a ratio to the measured one (goal: within 10 %).

``--json PATH`` also writes the figures, the machine and the date as the data file of
``docs/figures/bench_recompute.json`` (table of docs/benchmarks.md:
``scripts/bench_tables.py``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report

from cudakit.memory import estimate_memory
from cudakit.parallel import Recompute, recompute
from cudakit.parallel.recompute import find_blocks


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
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


POLICIES: dict[str, Recompute | None] = {
    "none": None,
    "full": Recompute("full"),
    "full, every 2nd block": Recompute("full", every=2),
    "selective": Recompute("selective"),
}


def _by_hand(model: nn.Module, spec: Recompute) -> nn.Module:
    """torch's checkpoint_wrapper on the same blocks, the way users apply it today."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    chosen = {id(m) for _, m in find_blocks(model, spec)}
    kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if spec.policy == "selective":
        keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

        def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, **kwargs),
        check_fn=lambda m: id(m) in chosen,
    )
    return model


def _build(name: str, hand: bool, depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = Net(depth, width)
    spec = POLICIES[name]
    if spec is not None:
        model = _by_hand(model, spec) if hand else recompute(model, spec)
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss = model(x).sum()
    loss.backward()
    del loss
    opt.step()


def measured_peak(model: nn.Module, shape: tuple[int, ...]) -> int:
    """Peak live tensor bytes over two steps, as torch's MemTracker sees them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    peak = 0
    with tracker:
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(shape)
        for _ in range(2):
            _step(model, opt, x)
            peak = max(peak, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            tracker.reset_mod_stats()
    return int(peak)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--json", default=None, help="write the data file here")
    args = parser.parse_args(argv)
    load = _report.load_average()
    depth, width, shape = (2, 32, (2, 8, 32)) if args.quick else (4, 128, (4, 128, 128))
    rounds = args.rounds or (2 if args.quick else 9)
    steps = 1 if args.quick else 3
    torch.set_num_threads(1)  # one thread: a busy 2-core machine's noise stays small
    variants = [(n, False) for n in POLICIES] + [(n, True) for n in POLICIES if n != "none"]
    labels = {v: f"{v[0]}{' (checkpoint_wrapper by hand)' if v[1] else ''}" for v in variants}
    runs: dict[tuple[str, bool], Callable[[], None]] = {}
    for v in variants:
        model = _build(v[0], v[1], depth, width)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(shape)
        _step(model, opt, x)  # warm

        def run(model: nn.Module = model, opt: torch.optim.Optimizer = opt, x: Any = x) -> None:
            for _ in range(steps):
                _step(model, opt, x)

        runs[v] = run
    times: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
    for i in range(rounds):
        for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
            t0 = time.perf_counter()
            runs[v]()
            times[v].append((time.perf_counter() - t0) / steps)
    rows = []
    base_time = statistics.median(times[("none", False)])
    base_peak = 0
    for v in variants:
        peak = measured_peak(_build(v[0], v[1], depth, width), shape)
        base_peak = base_peak or peak
        with torch.device("meta"):
            meta = Net(depth, width)
        estimate = estimate_memory(
            meta, torch.empty(shape, device="meta"), recompute=POLICIES[v[0]]
        )
        step = statistics.median(times[v])
        rows.append(
            {
                "policy": v[0],
                "implementation": "checkpoint_wrapper by hand" if v[1] else "cudakit",
                "step_ms": round(step * 1e3, 2),
                "time_ratio": round(step / base_time, 3),
                "peak_mib": round(peak / 2**20, 2),
                "peak_ratio": round(peak / base_peak, 3),
                "estimate_mib": round(estimate.peak / 2**20, 2),
                "estimate_ratio": round(estimate.peak / peak, 3),
            }
        )
    print(f"# {depth} blocks of width {width}, batch {shape}, AdamW, {rounds} rounds")
    print(
        f"{'variant':<48}{'ms/step':>9}{'x time':>8}{'peak MiB':>10}{'x peak':>8}{'est/meas':>10}"
    )
    for v, r in zip(variants, rows, strict=True):
        print(
            f"{labels[v]:<48}{r['step_ms']:>9.2f}{r['time_ratio']:>8.3f}"
            f"{r['peak_mib']:>10.2f}{r['peak_ratio']:>8.3f}{r['estimate_ratio']:>10.3f}"
        )
    # cudakit against the hand-applied wrapper: the median of each round's own ratio,
    # the two timed side by side in that round.
    paired = {}
    for name in POLICIES:
        if name != "none":
            ratios = [a / b for a, b in zip(times[(name, False)], times[(name, True)], strict=True)]
            paired[name] = statistics.median(ratios)
            print(f"# {name}: cudakit / by hand time = {paired[name]:.3f}x (goal <= 1.02x)")
    if args.json:
        settings = (
            f"{depth} blocks of width {width}, batch {list(shape)}, AdamW, {rounds} "
            f"interleaved rounds x {steps} steps, median wall time per step; peak of live "
            "tensor bytes over two steps (torch's MemTracker)"
        )
        chart = [
            {"group": f"{r['policy']}, {r['implementation']}", "series": s, "value": r[k]}
            for r in rows
            for s, k in (("time", "time_ratio"), ("peak", "peak_ratio"))
        ]
        data = _report.record(
            "benchmarks/bench_recompute.py",
            title="recompute on a CPU: time and peak per policy, x none",
            settings=settings,
            rows=chart,
            argv=argv,
            load_before=load,
            unit="x no recompute",
            table=rows,
            paired=paired,
        )
        _report.write(args.json, data)


if __name__ == "__main__":
    main()
