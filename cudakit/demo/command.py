"""``cudakit demo``'s entry point: parse, check, train (N processes with ``--nprocs``), report."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence

import torch

from .._check import fail_type
from .._dist import launched_local_world_size
from ..parallel import is_main_process, launch
from ._args import build_parser, check_args
from ._plot import plot_summary
from ._training import train
from .summary import DemoSummary

__all__ = ["finish", "launched", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cudakit demo``: train the demo CNN and print a summary; return the exit status.

    >>> from cudakit.demo import main
    >>> main(["--help"])
    Traceback (most recent call last):
    ...
    SystemExit: 0

    Args:
        argv: the arguments after ``demo`` (default ``sys.argv[1:]``); see ``--help``.

    Returns:
        0 when training ran (the summary says whether the loss fell); 1 when the
        ``--plot`` file could not be written (one line on stderr names it).

    Raises:
        TypeError: ``argv`` is not a list of strings (a single string, a number).
        SystemExit: bad arguments (status 2, with a message saying what to change),
            or ``--help`` (status 0).

    .. versionadded:: 0.1
    """
    given = list(sys.argv[1:]) if argv is None else _check_argv(argv)
    p = build_parser()
    args = p.parse_args(given)
    check_args(p, args)
    # --nprocs N: N local DDP processes; rank 0's summary comes back here.
    summary = launch(launched, args, nprocs=args.nprocs)[0] if args.nprocs > 1 else train(args)
    return finish(summary, args) if is_main_process() else 0


def _check_argv(argv: object) -> list[str]:
    """``argv`` as a list, refused unless it holds strings (a string would be read letter
    by letter)."""
    fix = "Pass a list of strings, e.g. main(['--epochs', '1']), or main('--epochs 1'.split())."
    if isinstance(argv, str | bytes) or not isinstance(argv, Iterable):
        fail_type("main", "argv", "a list of command-line arguments or None", argv, fix)
    items = list(argv)
    for item in items:
        if not isinstance(item, str):
            fail_type("main", "argv", "a list of strings", item, fix)
    return items


def launched(args: argparse.Namespace) -> DemoSummary:
    """One rank of ``--nprocs N`` (module level so that spawn can pickle it)."""
    # N processes share the cores: give each its share instead of all of them.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // launched_local_world_size()))
    return train(args)


def finish(summary: DemoSummary, args: argparse.Namespace) -> int:
    """Print the summary (a table, or JSON with ``--json``), then write the ``--plot`` PNG.

    Returns the exit status: 1 when the plot could not be written (said in one line on
    stderr that names the file), else 0.
    """
    # The summary first: a plot that fails to save must not take the results with it.
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary, flush=True)
    if args.plot is None:
        return 0
    try:
        plot_summary(summary, args.plot)
    except OSError as exc:  # a full disk, a folder removed or made read-only meanwhile
        reason = exc.strerror or str(exc)
        code = f" [Errno {exc.errno}]" if exc.errno is not None else ""
        print(
            f"cudakit demo: could not write the plot to {args.plot}: {reason}{code}; "
            "the summary above is complete.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if not args.json:
        print(f"plot written to {args.plot}")
    return 0
