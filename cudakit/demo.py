"""``cudakit demo``: train a small CNN with every cudakit utility in place.

The demo generates a CIFAR-10-shaped data set itself (3x32x32 images, 10 classes,
deterministic for a seed and learnable: each class is a smooth colour pattern seen
through random shifts, contrast and noise), trains a conv-bn-relu network on it for a
few epochs and prints the accuracy on a held-out split. Every utility is used the way
the docs recommend:

* :func:`~cudakit.device.resolve_device` picks the device, :func:`~cudakit.device.on_device`
  moves the loss module and the evaluation data;
* :func:`~cudakit.data.loader_kwargs` sets up the ``DataLoader`` and
  :func:`~cudakit.data.prefetch` copies batches ahead of the compute;
* :func:`~cudakit.warmup.warmup` runs the first passes without leaving a trace, and
  ``--batch-size auto`` uses :func:`~cudakit.warmup.find_batch_size`;
* :func:`~cudakit.amp.autocast_step` does the mixed-precision step with gradient
  accumulation (2), clipping (1.0) and a learning-rate schedule;
* :func:`~cudakit.memory.memory_report` measures every epoch;
* :func:`~cudakit.parallel.parallelize` wraps the model (DDP under ``torchrun`` or
  ``--nprocs N``, which goes through :func:`~cudakit.parallel.launch`).

Run it as ``cudakit demo`` or ``python -m cudakit demo``; ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import torch
from torch import Tensor, nn

from ._accel import synchronize
from ._dist import launched_local_world_size
from ._units import format_bytes
from .amp import AutocastStep, autocast_step
from .data import loader_kwargs, prefetch
from .device import on_device, resolve_device
from .memory import memory_report, memory_snapshot
from .parallel import (
    distributed_loader,
    is_main_process,
    launch,
    parallelize,
    process_group,
    read_env,
    unwrap,
)
from .warmup import find_batch_size, warmup

__all__ = ["DemoSummary", "EpochStats", "main", "make_dataset", "make_model"]

NUM_CLASSES = 10
ACCUMULATE = 2
MAX_GRAD_NORM = 1.0
_DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


# -- data and model -------------------------------------------------------------------


def make_dataset(
    n: int, *, seed: int = 0, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate a deterministic, learnable CIFAR-10-shaped data set.

    Each of the 10 classes is a smooth random colour pattern (fixed by ``seed``);
    an image is its class pattern shifted by up to 4 pixels, with random contrast,
    brightness and Gaussian noise. ``split`` picks an independent stream of images
    over the same patterns, so a ``"val"`` split measures generalisation.

    >>> images, labels = make_dataset(8, seed=1)
    >>> images.shape, images.dtype, labels.tolist()
    (torch.Size([8, 3, 32, 32]), torch.float32, [6, 1, 7, 5, 7, 5, 7, 0])
    >>> torch.equal(make_dataset(8, seed=1)[0], images)
    True

    Args:
        n: number of images.
        seed: fixes the class patterns and the images.
        split: ``"train"`` or ``"val"``; the two never share an image.

    Returns:
        ``(images, labels)``: a float32 tensor ``(n, 3, 32, 32)`` and an int64 tensor ``(n,)``.

    Raises:
        ValueError: ``n`` is not positive or ``split`` is unknown.

    .. versionadded:: 0.1
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"make_dataset() needs a positive number of images n, got {n!r}.")
    if split not in ("train", "val"):
        raise ValueError(f"make_dataset() split must be 'train' or 'val', got {split!r}.")
    patterns_gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(NUM_CLASSES, 3, 4, 4, generator=patterns_gen)
    patterns = nn.functional.interpolate(coarse, size=(40, 40), mode="bicubic", align_corners=False)
    patterns = (patterns - patterns.mean(dim=(1, 2, 3), keepdim=True)) / patterns.std(
        dim=(1, 2, 3), keepdim=True
    )
    gen = torch.Generator().manual_seed(seed * 2 + (1 if split == "val" else 0) + 1_000_003)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=gen)
    dy, dx = torch.randint(0, 9, (2, n), generator=gen).tolist()
    crops = _crop(patterns, labels, dy, dx)
    contrast = torch.empty(n, 1, 1, 1).uniform_(0.5, 1.5, generator=gen)
    brightness = torch.randn(n, 3, 1, 1, generator=gen) * 0.3
    noise = torch.randn(n, 3, 32, 32, generator=gen) * 2.5
    # A weaker pattern of another class on top makes the classes overlap.
    other = (labels + torch.randint(1, NUM_CLASSES, (n,), generator=gen)) % NUM_CLASSES
    distractor = _crop(patterns, other, dx, dy)
    images = crops * contrast + 0.6 * distractor + brightness + noise
    return images.contiguous(), labels


def _crop(patterns: torch.Tensor, classes: torch.Tensor, dy: list[int], dx: list[int]) -> Tensor:
    """A 32x32 window of each image's class pattern at offset (dy, dx)."""
    windows = zip(classes.tolist(), dy, dx, strict=True)
    return torch.stack([patterns[c, :, y : y + 32, x : x + 32] for c, y, x in windows])


def make_model(width: int = 16) -> nn.Sequential:
    """Build the demo's CNN: four conv-bn-relu blocks, global pooling and a linear head.

    >>> model = make_model(width=8)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])

    Args:
        width: channels of the first block; the others use 2x and 4x that.

    Returns:
        An ``nn.Sequential`` mapping ``(N, 3, 32, 32)`` images to ``(N, 10)`` logits.

    .. versionadded:: 0.1
    """

    def block(c_in: int, c_out: int, pool: bool) -> list[nn.Module]:
        layers: list[nn.Module] = [
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
        ]
        return [*layers, nn.MaxPool2d(2)] if pool else layers

    w = width
    return nn.Sequential(
        *block(3, w, pool=False),
        *block(w, 2 * w, pool=True),  # 16x16
        *block(2 * w, 4 * w, pool=True),  # 8x8
        *block(4 * w, 4 * w, pool=True),  # 4x4
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, NUM_CLASSES),
    )


# -- results ---------------------------------------------------------------------------


@dataclass
class EpochStats:
    """What one epoch of the demo measured (on this rank, samples/s for all ranks).

    .. versionadded:: 0.1
    """

    epoch: int
    train_loss: float
    val_loss: float
    val_accuracy: float
    samples_per_s: float
    seconds: float
    optimizer_steps: int
    skipped_steps: int
    peak_memory: int | None
    memory_kind: str


@dataclass
class DemoSummary:
    """The demo's result: the set-up it chose and one :class:`EpochStats` per epoch.

    ``str(summary)`` is the table ``cudakit demo`` prints; ``to_dict()`` is what
    ``--json`` prints.

    .. versionadded:: 0.1
    """

    device: str
    dtype: str
    strategy: str
    world_size: int
    batch_size: int
    accumulate: int
    max_grad_norm: float
    train_samples: int
    val_samples: int
    seed: int
    warmup_first_pass_s: float | None
    warmup_last_pass_s: float | None
    first_loss: float
    final_loss: float
    final_accuracy: float
    epochs: list[EpochStats] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list, repr=False)
    step_memory: list[int] = field(default_factory=list, repr=False)

    @property
    def loss_fell(self) -> bool:
        """Whether training lowered the loss (last steps against the first ones)."""
        return self.final_loss < self.first_loss

    @property
    def steps_skipped(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient, all epochs."""
        return sum(e.skipped_steps for e in self.epochs)

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-ready data (per-step series omitted)."""
        out = asdict(self)
        del out["step_losses"], out["step_memory"]
        out["loss_fell"] = self.loss_fell
        out["steps_skipped"] = self.steps_skipped
        return out

    def __str__(self) -> str:
        warm = (
            f"{self.warmup_first_pass_s * 1e3:.1f} ms first pass, "
            f"{self.warmup_last_pass_s * 1e3:.1f} ms last pass"
            if self.warmup_first_pass_s is not None and self.warmup_last_pass_s is not None
            else "skipped"
        )
        head = [
            ("device", self.device),
            ("dtype", self.dtype),
            ("parallel", f"{self.strategy} ({_plural(self.world_size, 'process')})"),
            (
                "batch",
                f"{self.batch_size} per process x {self.accumulate} accumulated, "
                f"clip {self.max_grad_norm}",
            ),
            ("data", f"{self.train_samples} train / {self.val_samples} held-out images"),
            ("warm-up", warm),
            ("steps skipped", str(self.steps_skipped)),
        ]
        width = max(len(k) for k, _ in head)
        lines = [f"{k:<{width}}  {v}" for k, v in head]
        cols = ("epoch", "train loss", "val loss", "val acc", "samples/s", "peak mem", "skipped")
        rows = [
            (
                str(e.epoch),
                f"{e.train_loss:.4f}",
                f"{e.val_loss:.4f}",
                f"{e.val_accuracy:.1%}",
                f"{e.samples_per_s:,.0f}",
                format_bytes(e.peak_memory) + (" RSS" if e.memory_kind == "rss" else ""),
                str(e.skipped_steps),
            )
            for e in self.epochs
        ]
        widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(cols)]
        lines.append("")
        lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
        lines.append("  ".join("-" * w for w in widths))
        lines.extend("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows)
        lines.append("")
        verdict = "fell" if self.loss_fell else "did NOT fall"
        lines.append(
            f"loss {verdict}: {self.first_loss:.4f} -> {self.final_loss:.4f}; "
            f"final held-out accuracy {self.final_accuracy:.1%} (chance: {1 / NUM_CLASSES:.0%})"
        )
        return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


# -- command line ----------------------------------------------------------------------


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


def _parser() -> argparse.ArgumentParser:
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
        choices=sorted(_DTYPES),
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
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument(
        "--plot", metavar="FILE.png", help="write a PNG of the loss and the memory per step"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar, one line per epoch")
    return p


def _default_train_size(device: torch.device) -> int:
    return 2048 if device.type == "cpu" else 16384


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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
    try:
        device = resolve_device(args.device)
    except (ValueError, TypeError) as exc:
        p.error(f"--device {args.device}: {exc}")
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
    n_train = args.train_size or _default_train_size(device)
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
        0 when training ran (the summary says whether the loss fell).

    Raises:
        SystemExit: bad arguments (status 2, with a message saying what to change),
            or ``--help`` (status 0).

    .. versionadded:: 0.1
    """
    p = _parser()
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    _check_args(p, args)
    # --nprocs N: N local DDP processes; rank 0's summary comes back here.
    summary = launch(_launched, args, nprocs=args.nprocs)[0] if args.nprocs > 1 else _train(args)
    if is_main_process():
        _finish(summary, args)
    return 0


def _launched(args: argparse.Namespace) -> DemoSummary:
    """One rank of ``--nprocs N`` (module level so that spawn can pickle it)."""
    # N processes share the cores: give each its share instead of all of them.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // launched_local_world_size()))
    return _train(args)


def _finish(summary: DemoSummary, args: argparse.Namespace) -> None:
    # The summary first: a plot that fails to save must not take the results with it.
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary, flush=True)
    if args.plot is not None:
        _plot(summary, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")


def _plot(summary: DemoSummary, path: str) -> None:
    # The object-oriented API with no pyplot: no display needed, and the caller's
    # matplotlib backend and global state are left alone.
    # (Imported by name so that type checking works without the optional extra.)
    figure_cls = importlib.import_module("matplotlib.figure").Figure

    fig = figure_cls(figsize=(8, 6))
    ax_loss, ax_mem = fig.subplots(2, 1, sharex=True)
    steps = range(1, len(summary.step_losses) + 1)
    ax_loss.plot(steps, summary.step_losses, linewidth=1)
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title(f"cudakit demo on {summary.device} ({summary.dtype})")
    kind = "RSS" if summary.device.startswith("cpu") else "allocated"
    ax_mem.plot(steps, [m / 2**20 for m in summary.step_memory], linewidth=1, color="tab:orange")
    ax_mem.set_ylabel(f"memory {kind} (MiB)")
    ax_mem.set_xlabel("micro-step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- training --------------------------------------------------------------------------


class _Progress:
    """A tqdm bar per epoch when tqdm is installed, else one plain line per epoch."""

    def __init__(self, total: int, desc: str, *, enabled: bool, bar: bool = True) -> None:
        self.desc = desc
        self.bar: Any = None
        self.enabled = enabled
        if enabled and bar:
            try:
                tqdm = importlib.import_module("tqdm.auto").tqdm
            except ImportError:  # the optional "progress" extra is not installed
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=True)

    def update(self, n: int, *, loss: float | None, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:,.0f}")

    def close(self, line: str) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled:
            print(f"{self.desc}: {line}", file=sys.stderr, flush=True)


def _schedule(total_steps: int) -> Any:
    """Linear warm-up over 10% of the steps, then cosine decay to 5%."""
    warm = max(1, total_steps // 10)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _train(args: argparse.Namespace) -> DemoSummary:
    # Under torchrun or --nprocs, join the process group first: set_device(LOCAL_RANK)
    # must run before anything touches CUDA. The group is torn down when the block ends.
    env = read_env()
    if env is not None and env.world_size > 1:
        spec = None if args.device in ("auto", "cuda") else args.device
        with process_group(device=spec) as group:
            return _run(args, group.device, group.world_size, group.rank)
    return _run(args, resolve_device(args.device), 1, 0)


def _find_batch_size(
    model: nn.Module, loss_fn: nn.Module, step: AutocastStep, device: torch.device, cap: int
) -> int:
    """``--batch-size auto``: the largest batch (multiple of 8) a training step fits in."""
    probe = copy.deepcopy(model)  # trials train a throwaway copy: the real model is untouched

    def trial(batch_size: int) -> None:
        x = torch.randn(batch_size, 3, 32, 32, device=device)
        y = torch.randint(0, NUM_CLASSES, (batch_size,), device=device)
        with step.autocast():
            loss = loss_fn(probe(x), y)
        loss.backward()
        probe.zero_grad(set_to_none=True)

    return find_batch_size(trial, start=64, lower=8, upper=cap, multiple_of=8, margin=0.1)


def _all_reduce(
    values: list[float], device: torch.device, world: int, *, op: str = "sum"
) -> list[float]:
    """Sum (or ``op="min"``) ``values`` over the ranks; the values themselves on one process."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    reduce_op = torch.distributed.ReduceOp.MIN if op == "min" else torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(t, op=reduce_op)
    return [float(v) for v in t.tolist()]


def _evaluate(
    model: nn.Module,
    loss_fn: nn.Module,
    step: AutocastStep,
    images: torch.Tensor,
    labels: torch.Tensor,
    world: int,
) -> tuple[float, float]:
    """Held-out loss and accuracy (each rank scores its share, then the sums are reduced).

    Under DDP each rank's BatchNorm statistics took its own last batch after rank 0's
    were broadcast; broadcast them once more so that every rank scores the same model.
    """
    if world > 1:
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)
    model.eval()
    loss_sum = correct = 0.0
    with torch.no_grad(), step.autocast():
        for i in range(0, len(images), 512):
            logits = model(images[i : i + 512])
            target = labels[i : i + 512]
            loss_sum += float(loss_fn(logits.float(), target)) * len(target)
            correct += float((logits.argmax(dim=1) == target).sum())
    model.train()
    loss_sum, correct, count = _all_reduce(
        [loss_sum, correct, float(len(images))], images.device, world
    )
    return loss_sum / count, correct / count


def _run(args: argparse.Namespace, device: torch.device, world: int, rank: int) -> DemoSummary:
    """Train with the global RNGs and ``cudnn.benchmark`` put back afterwards.

    ``main()`` may be called from Python (a notebook, the tests): the demo seeds torch
    and turns on cuDNN autotuning, and must not leave either behind.
    """
    cuda_devices = [device.index or 0] if device.type == "cuda" else []
    benchmark = torch.backends.cudnn.benchmark
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            if device.type == "cuda":
                torch.backends.cudnn.benchmark = True  # warmup() autotunes up front
            return _train_loop(args, device, world, rank)
        finally:
            torch.backends.cudnn.benchmark = benchmark


def _train_loop(
    args: argparse.Namespace, device: torch.device, world: int, rank: int
) -> DemoSummary:
    main_rank = rank == 0
    n_train = args.train_size or _default_train_size(device)
    n_val = max(256, n_train // 4)

    # Data: made in memory on the CPU (identically on every rank); each rank trains on
    # its own shard and scores its own share of the held-out split.
    train_x, train_y = make_dataset(n_train, seed=args.seed, split="train")
    val_x, val_y = make_dataset(n_val, seed=args.seed, split="val")
    val_x, val_y = on_device(val_x[rank::world], val_y[rank::world], device=device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = make_model().to(device)
    loss_fn = on_device(nn.CrossEntropyLoss(), device=device)
    dtype = _DTYPES[args.dtype]

    batch_size: int
    if args.batch_size != "auto":
        batch_size = args.batch_size
    else:
        probe_opt = torch.optim.SGD(model.parameters(), lr=0.0)
        probe_step = autocast_step(probe_opt, dtype=dtype)
        cap = max(8, min(1024, n_train // (world * 8)) // 8 * 8)
        found = _find_batch_size(model, loss_fn, probe_step, device, cap)
        # Every rank must use the same size: take the smallest any rank found.
        batch_size = int(_all_reduce([float(found)], device, world, op="min")[0])

    model = parallelize(model, device=device)
    lr = 2e-3 * math.sqrt(batch_size * ACCUMULATE * world / 128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    loader = distributed_loader(
        torch.utils.data.TensorDataset(train_x, train_y),
        batch_size=batch_size,
        shuffle=True,
        seed=args.seed,
        drop_last=True,
        # The images already sit in memory: worker processes would only add start-up
        # time, so keep them at 0 and take pinning from loader_kwargs().
        **loader_kwargs(device, num_workers=0),
    )
    micro_steps = len(loader)
    total_steps = args.epochs * math.ceil(micro_steps / ACCUMULATE)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(total_steps))
    step = autocast_step(
        optimizer,
        model=model,
        dtype=dtype,
        accumulate=ACCUMULATE,
        max_grad_norm=MAX_GRAD_NORM,
        scheduler=scheduler,
    )

    @step
    def train_step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(model(images), labels)
        return loss

    # Warm-up: the first passes pick kernels and grow the allocator; warmup() puts the
    # weights, BatchNorm statistics, optimizer state and RNGs back exactly afterwards.
    example = on_device(train_x[:batch_size], train_y[:batch_size], device=device)
    warm = warmup(
        model,
        example,
        loss_fn=loss_fn,  # the criterion, called as loss_fn(model(images), labels)
        steps=2,
        optimizer=optimizer,
        amp=step,
    )
    del example

    record_memory = args.plot is not None
    step_losses: list[torch.Tensor] = []
    step_memory: list[int] = []
    epochs: list[EpochStats] = []
    for epoch in range(1, args.epochs + 1):
        progress = _Progress(
            micro_steps, f"epoch {epoch}/{args.epochs}", enabled=main_rank, bar=not args.no_progress
        )
        steps_before, skipped_before = step.steps, step.skipped_steps
        epoch_losses: list[torch.Tensor] = []
        synchronize(device)
        start = time.perf_counter()
        with memory_report(f"epoch {epoch}", device=device, file=None) as mem:
            for i, (images, labels) in enumerate(prefetch(loader, device), start=1):
                result = train_step(images, labels)
                epoch_losses.append(result.loss)
                if record_memory:
                    step_memory.append(memory_snapshot(device).allocated)
                if i % 10 == 0 or i == micro_steps:  # .item() syncs: not on every step
                    elapsed = time.perf_counter() - start
                    progress.update(
                        10 if i % 10 == 0 else i % 10,
                        loss=float(result.loss),
                        samples_per_s=i * batch_size * world / elapsed,
                    )
            step.flush()  # a partial accumulation window still updates the weights
            synchronize(device)
        seconds = time.perf_counter() - start
        losses = torch.stack(epoch_losses).float().cpu()  # one sync per epoch
        step_losses.extend(losses)
        train_loss = _all_reduce([float(losses.mean())], device, world)[0] / world
        val_loss, val_acc = _evaluate(unwrap(model), loss_fn, step, val_x, val_y, world)
        stats = EpochStats(
            epoch=epoch,
            train_loss=train_loss,
            val_loss=val_loss,
            val_accuracy=val_acc,
            samples_per_s=micro_steps * batch_size * world / seconds,
            seconds=seconds,
            optimizer_steps=step.steps - steps_before,
            skipped_steps=step.skipped_steps - skipped_before,
            peak_memory=mem.peak_allocated,
            memory_kind="rss" if device.type == "cpu" else "allocated",
        )
        epochs.append(stats)
        progress.close(
            f"train loss {stats.train_loss:.4f}, held-out loss {val_loss:.4f}, "
            f"accuracy {val_acc:.1%}, {stats.samples_per_s:,.0f} samples/s, "
            f"{seconds:.1f} s"
        )

    k = max(1, min(8, micro_steps // 4))
    all_losses = [float(v) for v in step_losses]
    return DemoSummary(
        device=str(device),
        dtype=str(step.dtype).removeprefix("torch.") if step.enabled else "float32",
        strategy=type(model).__name__ if model is not unwrap(model) else "none",
        world_size=world,
        batch_size=batch_size,
        accumulate=ACCUMULATE,
        max_grad_norm=MAX_GRAD_NORM,
        train_samples=n_train,
        val_samples=n_val,
        seed=args.seed,
        warmup_first_pass_s=warm.first_pass_s,
        warmup_last_pass_s=warm.last_pass_s,
        first_loss=sum(all_losses[:k]) / k,
        final_loss=sum(all_losses[-k:]) / k,
        final_accuracy=epochs[-1].val_accuracy,
        epochs=epochs,
        step_losses=all_losses,
        step_memory=step_memory,
    )
