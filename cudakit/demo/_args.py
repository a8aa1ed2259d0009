"""The demo's command line: its options, and the checks made before anything runs."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
from collections.abc import Callable
from typing import Final

import torch

from ..device import resolve_device
from ..parallel import read_env

__all__ = [
    "DTYPES",
    "MAX_EPOCHS",
    "MAX_NPROCS",
    "MAX_SEED",
    "MAX_TRAIN_SIZE",
    "build_parser",
    "check_args",
    "default_train_size",
]

DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}

#: The largest values the options take: beyond them the demo cannot run (a seed torch
#: cannot take, a data set that does not fit in memory, more processes than sense).
MAX_SEED: Final = 2**62
MAX_EPOCHS: Final = 10_000
MAX_TRAIN_SIZE: Final = 1_000_000  # 12 KiB an image: 12 GiB
MAX_NPROCS: Final = 256


def _int_in(
    minimum: int, maximum: int, *, what: str = "a positive integer"
) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer in ``[minimum, maximum]``, with a clear message."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(
                f"expected {what}, at most {maximum}; got {value}. Use a smaller number."
            )
        return value

    return parse


_positive_int = _int_in(1, 2**31)


def _batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or 'auto' (search with find_batch_size), got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cudakit demo",
        description=(
            "Train a small CNN on a generated CIFAR-10-shaped data set with every cudakit "
            "utility in place: device detection, on_device, prefetch, warmup, autocast_step "
            "(accumulation 2, clipping 1.0), memory_report per epoch and parallelize."
        ),
        epilog=(
            "Several processes: `cudakit demo --nprocs 2`, or "
            "`torchrun --nproc-per-node 2 -m cudakit demo`."
        ),
    )
    p.add_argument(
        "--epochs", type=_int_in(1, MAX_EPOCHS), default=3, metavar="N", help="epochs (default 3)"
    )
    p.add_argument(
        "--batch-size",
        type=_batch_size,
        default=64,
        metavar="N|auto",
        help="batch size per process, or 'auto' to search the largest that fits (default 64)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="auto",
        help="autocast dtype; auto: bf16 where native, else fp16 on a GPU, float32 on a CPU "
        "without native bf16 (default auto)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps (default auto)")
    p.add_argument(
        "--seed",
        type=_int_in(0, MAX_SEED, what="a non-negative integer seed"),
        default=0,
        metavar="N",
        help="seed of the data and the weights",
    )
    p.add_argument(
        "--train-size",
        type=_int_in(1, MAX_TRAIN_SIZE),
        default=None,
        metavar="N",
        help="training images (default 2048 on a CPU, 16384 on a GPU); a quarter as many held "
        "out, at least 256",
    )
    p.add_argument(
        "--nprocs",
        type=_int_in(1, MAX_NPROCS),
        default=1,
        metavar="N",
        help="train with DDP in N local processes (through cudakit.parallel.launch)",
    )
    p.add_argument(
        "--resume",
        metavar="DIR",
        default=None,
        help="save a checkpoint in DIR every epoch (and on SIGTERM/SIGUSR1) and continue "
        "from the newest one there when started again (cudakit.Checkpointer)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument(
        "--plot", metavar="FILE.png", help="write a PNG of the loss and the memory per step"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar, one line per epoch")
    return p


def default_train_size(device: torch.device) -> int:
    return 2048 if device.type == "cpu" else 16384


def _parents(path: str) -> list[str]:
    """The folders above ``path``, nearest first."""
    out, current = [], os.path.abspath(path)
    while os.path.dirname(current) != current:
        current = os.path.dirname(current)
        out.append(current)
    return out


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written, or ``None``: opened for appending and left as it was.

    Permissions alone do not say (root passes every ``os.access`` test, a read-only mount
    does not show in the mode bits), so the file is opened: an existing one is not
    changed, a new one is removed again. Under a launcher only rank 0 tries.
    """
    env = read_env()
    if env is not None and env.rank != 0:
        return None
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return None


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject what cannot work before any process starts or any data is made."""
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            p.error(
                f"--plot {args.plot} needs matplotlib, which is not installed; "
                "install it with `pip install 'cudakit[plot]'` (or `pip install matplotlib`), "
                "or drop --plot."
            )
        if not args.plot.lower().endswith(".png"):
            p.error(
                f"--plot {args.plot}: the plot is a PNG; give a file name ending in .png, "
                f"e.g. --plot {os.path.splitext(args.plot)[0] or 'demo'}.png."
            )
        if os.path.isdir(args.plot):
            p.error(f"--plot {args.plot} is a folder; give a file name such as demo.png.")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            p.error(
                f"--plot {args.plot}: the folder {folder} does not exist; create it first "
                "or write the plot somewhere else."
            )
        problem = _unwritable(args.plot)
        if problem is not None:
            p.error(
                f"--plot {args.plot}: the file cannot be written ({problem}); choose a place "
                "you can write, e.g. --plot demo.png."
            )
    if args.resume is not None:
        existing = next(
            (q for q in [args.resume, *_parents(args.resume)] if os.path.exists(q)), None
        )
        if existing is not None and not os.path.isdir(existing):
            p.error(
                f"--resume {args.resume}: {existing} is a file, not a folder; give a folder "
                "for the checkpoints (it is made if missing)."
            )
        if existing is not None and not os.access(existing, os.W_OK):
            p.error(f"--resume {args.resume}: {existing} cannot be written; choose another folder.")
    try:
        device = resolve_device(args.device)
    except (ValueError, TypeError) as exc:
        text = str(exc)  # without resolve_device's own name: the flag is named here
        head = f"resolve_device(spec={args.device!r}): "
        p.error(f"--device {args.device}: {text.removeprefix(head)}")
    if device.type == "meta":
        p.error(
            f"--device {args.device} holds no data, so the demo cannot train or measure "
            "anything there; use --device cpu, --device cuda or leave --device out."
        )
    env = read_env()
    if args.nprocs > 1 and env is not None:
        p.error(
            f"--nprocs {args.nprocs} was given inside a launcher (WORLD_SIZE="
            f"{env.world_size}); use either `torchrun --nproc-per-node N -m "
            "cudakit demo` or `cudakit demo --nprocs N`, not both."
        )
    world = args.nprocs if args.nprocs > 1 else (env.world_size if env is not None else 1)
    local = args.nprocs if args.nprocs > 1 else (env.local_world_size if env is not None else 1)
    if local > 1 and device.type == "cuda":
        if args.device not in ("auto", "cuda"):
            p.error(
                f"--device {args.device} would put all {local} processes of this machine on "
                "one GPU; with several processes each takes its own (cuda:LOCAL_RANK): use "
                "--device cuda or leave --device out."
            )
        gpus = torch.cuda.device_count()
        if args.nprocs > gpus:
            p.error(
                f"--nprocs {args.nprocs} starts one process per GPU, but this machine has "
                f"{gpus} visible GPU(s); use --nprocs {gpus}, or --device cpu for CPU processes."
            )
    # Each process trains on its shard: ceil(n / world) images, whole batches only.
    n_train = args.train_size or default_train_size(device)
    share = -(-n_train // world)
    have = (
        f"the {n_train} training images"
        if world == 1
        else f"each process's share of the {n_train} training images ({share})"
    )
    if args.batch_size == "auto" and share < 8:
        p.error(
            f"--batch-size auto searches multiples of 8, more than {have}; "
            f"use --train-size {8 * world} or more."
        )
    if args.batch_size != "auto" and args.batch_size > share:
        p.error(
            f"--batch-size {args.batch_size} is larger than {have}, so not one batch would "
            f"run; use --batch-size {share} or less, or a larger --train-size."
        )
