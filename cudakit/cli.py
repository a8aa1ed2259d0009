"""The ``cudakit`` command: ``cudakit info``, ``cudakit demo`` and ``cudakit estimate``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._version import __version__

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cudakit",
        description="Fast, correct PyTorch training on NVIDIA GPUs.",
    )
    parser.add_argument("--version", action="version", version=f"cudakit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="report torch, CUDA, cuDNN and every GPU")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.add_parser(
        "demo",
        help="train a small CNN with every cudakit utility (see `cudakit demo --help`)",
        add_help=False,
    )
    from .memory._command import add_parser

    add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cudakit`` command line; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "demo":
        from .demo import main as demo_main

        return int(demo_main(args_list[1:]))
    parser = _parser()
    args = parser.parse_args(args_list)
    if args.command == "info":
        from .info import device_info

        report = device_info(init_cuda=True)
        print(report.to_json() if args.json else report)
        return 0
    if args.command == "estimate":
        from .memory._command import run

        return run(args)
    parser.print_help()
    return 2
