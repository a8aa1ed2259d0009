"""``cudakit estimate``: :func:`~cudakit.memory.estimate_memory` from the command line.

``cudakit estimate pkg.models:build --batch 8,2048:int64 --strategy fsdp
--world-size 64 --recompute full --fit 80GiB`` imports the factory, builds the model
on fake tensors, and prints each rank's peak with its parts; ``--fit`` adds the
largest batch per rank that fits, and a line per strategy and recompute policy.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._units import format_bytes
from .estimate import estimate_memory, largest_batch

__all__ = ["add_parser", "run"]

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adagrad": "Adagrad"}


def parse_size(text: str) -> int:
    """``"80GiB"`` -> bytes (``GiB`` binary, ``GB`` decimal, plain digits bytes)."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if found is None or found.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"--fit expects a size such as 80GiB or 40GB, got {text!r}"
        )
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


def parse_batch(text: str) -> torch.Tensor:
    """``"8,2048:int64"`` -> a meta tensor of that shape and dtype (default float32)."""
    shape_text, _, dtype_text = text.partition(":")
    dtype = getattr(torch, dtype_text or "float32", None)
    try:
        shape = tuple(int(d) for d in shape_text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1 or not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(
            f"--batch expects a shape and an optional dtype such as 8,2048:int64, got {text!r}"
        )
    return torch.empty(shape, dtype=dtype, device="meta")


def _factory(spec: str) -> Callable[[], torch.nn.Module]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SystemExit(
            f"cudakit estimate: MODEL expects module:function (e.g. mypkg.models:build), "
            f"got {spec!r}."
        )
    sys.path.insert(0, "")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"cudakit estimate: cannot load {spec!r}: {exc}.") from None
    if not callable(obj):
        raise SystemExit(f"cudakit estimate: {spec!r} is not callable; name a model factory.")
    return obj  # type: ignore[no-any-return]


def add_parser(sub: Any) -> None:
    """Add ``estimate`` to the ``cudakit`` command's subcommands."""
    p = sub.add_parser("estimate", help="predict each rank's peak memory before launch")
    p.add_argument("model", metavar="MODEL", help="a model factory, module:function")
    p.add_argument(
        "--batch", type=parse_batch, required=True, help="one rank's batch: 8,2048[:int64]"
    )
    p.add_argument("--strategy", default="none", choices=("none", "ddp", "fsdp"))
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--recompute", default=None, choices=("full", "selective"))
    p.add_argument("--optimizer", default="adamw", choices=sorted(_OPTIMIZERS))
    p.add_argument("--fit", type=parse_size, default=None, help="memory per rank, e.g. 80GiB")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    """Carry out ``cudakit estimate``; the exit status."""
    build = _factory(args.model)
    options: dict[str, Any] = {
        "strategy": args.strategy,
        "world_size": args.world_size,
        "precision": args.precision,
        "recompute": args.recompute,
        "optimizer": getattr(torch.optim, _OPTIMIZERS[args.optimizer]),
    }
    try:
        est = estimate_memory(build, args.batch, **options)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"cudakit estimate: {exc}") from None
    out: dict[str, Any] = est.to_dict()
    lines = [str(est)]
    if args.fit is not None:
        out["fit"] = args.fit
        out["choices"] = []
        lines.append(f"\nfits in {format_bytes(args.fit)} per rank:")
        strategies = ("none",) if args.world_size == 1 else ("ddp", "fsdp")
        for strategy in strategies:
            for policy in (None, "selective", "full"):
                chosen = {**options, "strategy": strategy, "recompute": policy}
                size, best = largest_batch(build, args.batch, args.fit, **chosen)
                row = {"strategy": strategy, "recompute": policy or "none", "batch": size}
                out["choices"].append(row)
                peak = format_bytes(best.peak) if best is not None else "-"
                lines.append(
                    f"  {strategy:<5} recompute {row['recompute']:<10} largest batch "
                    f"{size:>6}  (peak {peak})"
                )
    print(json.dumps(out, indent=1) if args.json else "\n".join(lines))
    return 0


def main(argv: Sequence[str]) -> int:
    """``cudakit estimate`` alone (for tests)."""
    parser = argparse.ArgumentParser(prog="cudakit")
    add_parser(parser.add_subparsers(dest="command"))
    return run(parser.parse_args(["estimate", *argv]))
