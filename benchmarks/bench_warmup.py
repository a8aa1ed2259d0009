"""Benchmark cudakit.warmup: the warm-up effect, what the no-trace guarantee costs, reserve.

Run ``python benchmarks/bench_warmup.py`` (``--quick`` for a smoke run,
``--device cuda`` on a GPU machine). One process, interleaved rounds, medians:

* cold start: first-pass vs last-pass time of the very first ``warmup()`` in the
  process (kernels, allocator and, on CUDA, cuDNN autotuning are cold only once);
* overhead: one ``warmup(steps=1)`` (snapshot + pass + bit-exact restore) over one bare
  forward+backward pass, same model, interleaved;
* reserve (CUDA only): time to allocate a large activation-sized tensor straight from
  the driver (after ``empty_cache()``) vs. from memory ``warmup(reserve=...)`` cached;
* find_batch_size: tries needed to find the exact largest fitting size.

``--json PATH`` also writes the figures, the machine and the date as the data file of
``docs/figures/bench_warmup.json`` (chart: ``scripts/make_figures.py``; table of
docs/benchmarks.md: ``scripts/bench_tables.py``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report

from cudakit.warmup import find_batch_size, warmup


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    )


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_pass(model: nn.Module, batch: Any, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    loss_fn(model, batch).backward()
    sync(device)
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, small model")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the data file")
    args = parser.parse_args(argv)
    load = _report.load_average()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    rounds = 5 if args.quick else 21
    width, n, side = (16, 16, 32) if args.quick else (32, 64, 64)
    if device.type == "cuda":
        width, n, side = 64, 128, 128

    torch.manual_seed(0)
    model = make_model(width).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = (
        torch.randn(n, 3, side, side, device=device),
        torch.randint(0, 10, (n,), device=device),
    )
    cold = warmup(model, batch, loss_fn=loss_fn, steps=3, optimizer=opt)  # first work done
    print(cold)
    loss_fn(model, batch).backward()  # give the optimizer real state to preserve
    opt.step()
    opt.zero_grad(set_to_none=True)

    bare: list[float] = []
    warm: list[float] = []
    for _ in range(rounds):  # interleaved
        bare.append(bare_pass(model, batch, device))
        sync(device)
        t0 = time.perf_counter()
        warmup(model, batch, loss_fn=loss_fn, steps=1, optimizer=opt)
        sync(device)
        warm.append(time.perf_counter() - t0)

    rows: list[tuple[str, str]] = [
        ("cold first pass / last pass (first warmup in process)", f"{cold.speedup:.2f}x"),
        ("first pass, ms", f"{(cold.first_pass_s or 0) * 1e3:.1f}"),
        ("last pass, ms", f"{(cold.last_pass_s or 0) * 1e3:.1f}"),
        ("bare fwd+bwd pass, median ms", f"{statistics.median(bare) * 1e3:.1f}"),
        (
            "warmup(steps=1) incl. snapshot+restore, median ms",
            f"{statistics.median(warm) * 1e3:.1f}",
        ),
        (
            "no-trace overhead (warmup(steps=1) / bare pass), median",
            f"{statistics.median(w / b for w, b in zip(warm, bare, strict=True)):.2f}x",
        ),
    ]

    if device.type == "cuda":
        size = 2 * 2**30
        cold_alloc: list[float] = []
        cached_alloc: list[float] = []
        for _ in range(rounds):
            torch.cuda.empty_cache()
            sync(device)
            t0 = time.perf_counter()
            x = torch.empty(size, dtype=torch.uint8, device=device)
            sync(device)
            cold_alloc.append(time.perf_counter() - t0)
            del x
            torch.cuda.empty_cache()
            warmup(reserve=size, device=device)
            sync(device)
            t0 = time.perf_counter()
            x = torch.empty(size, dtype=torch.uint8, device=device)
            sync(device)
            cached_alloc.append(time.perf_counter() - t0)
            del x
        rows += [
            (
                "2 GiB allocation from the driver, median ms",
                f"{statistics.median(cold_alloc) * 1e3:.3f}",
            ),
            (
                "2 GiB allocation after reserve, median ms",
                f"{statistics.median(cached_alloc) * 1e3:.3f}",
            ),
        ]

    tries: list[int] = []

    def trial(bs: int) -> None:
        tries.append(bs)
        if bs > 1000:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated above 1000)")

    found = find_batch_size(trial, start=1)
    rows.append((f"find_batch_size, limit 1000, start 1: found {found} in", f"{len(tries)} tries"))

    print()
    print(
        f"device={device} torch={torch.__version__} python={platform.python_version()} "
        f"machine={platform.machine()} rounds={rounds} batch={n}x3x{side}x{side} width={width}"
    )
    key_w = max(len(k) for k, _ in rows)
    print(f"| {'measure'.ljust(key_w)} | value |")
    print(f"|{'-' * (key_w + 2)}|-------|")
    for key, value in rows:
        print(f"| {key.ljust(key_w)} | {value} |")
    if args.json:
        ms = {
            "first pass (first warmup in process)": (cold.first_pass_s or 0) * 1e3,
            "last pass": (cold.last_pass_s or 0) * 1e3,
            "bare fwd+bwd pass, median": statistics.median(bare) * 1e3,
            "warmup(steps=1) incl. snapshot+restore, median": statistics.median(warm) * 1e3,
        }
        settings = (
            f"device {device}, {rounds} interleaved rounds, batch {n}x3x{side}x{side}, "
            "a two-conv CNN with BatchNorm and Dropout, Adam, wall time"
        )
        _report.write(args.json, figure_data(rows, ms, device.type, settings, argv, load))


def figure_data(
    table: list[tuple[str, str]],
    ms: dict[str, float],
    device_type: str,
    settings: str,
    argv: list[str] | None,
    load: float,
) -> dict[str, Any]:
    """The run as the data file of docs/figures/bench_warmup.json: the chart's passes in
    ``ms``, the printed table in ``table``."""
    return _report.record(
        "benchmarks/bench_warmup.py",
        title=f"warmup on {'a GPU' if device_type == 'cuda' else 'a CPU'}: pass times, and "
        "what the no-trace guarantee costs",
        settings=settings,
        argv=argv,
        load_before=load,
        unit="ms",
        table=[{"measure": key, "value": value} for key, value in table],
        rows=[{"group": k, "series": "ms", "value": round(v, 1)} for k, v in ms.items()],
    )


if __name__ == "__main__":
    main()
