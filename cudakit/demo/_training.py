"""The demo's training loop: one process's run, from the data to the :class:`DemoSummary`."""

from __future__ import annotations

import argparse
import copy
import math
import time
from typing import Any

import torch
from torch import nn

from .._accel import synchronize
from ..amp import AutocastStep, autocast_step
from ..checkpoint import Checkpointer
from ..data import loader_kwargs, prefetch
from ..device import on_device, resolve_device
from ..memory import memory_report, memory_snapshot
from ..parallel import distributed_loader, parallelize, process_group, read_env, unwrap
from ..speed import count_flops, speed_report
from ..warmup import find_batch_size, warmup
from ._args import DTYPES, default_train_size
from ._evaluation import all_reduce, evaluate
from ._progress import Progress
from .data import NUM_CLASSES, make_dataset
from .model import make_model
from .summary import DemoSummary, EpochStats

__all__ = ["ACCUMULATE", "MAX_GRAD_NORM", "train"]

ACCUMULATE = 2
MAX_GRAD_NORM = 1.0


def _schedule(steps_per_epoch: int) -> Any:
    """Linear warm-up over half an epoch, then inverse-square-root decay.

    The schedule does not depend on ``--epochs``: a run resumed with more epochs follows
    the learning rates of a run that had asked for them from the start.
    """
    warm = max(1, steps_per_epoch // 2)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return math.sqrt(warm / (step + 1))

    return factor


def train(args: argparse.Namespace) -> DemoSummary:
    """Train the demo in this process (one rank under a launcher); return its summary."""
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
    n_train = args.train_size or default_train_size(device)
    n_val = max(256, n_train // 4)

    # Data: made in memory on the CPU (identically on every rank); each rank trains on
    # its own shard and scores its own share of the held-out split.
    train_x, train_y = make_dataset(n_train, seed=args.seed, split="train")
    val_x, val_y = make_dataset(n_val, seed=args.seed, split="val")
    val_x, val_y = on_device(val_x[rank::world], val_y[rank::world], device=device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = make_model().to(device)
    loss_fn = on_device(nn.CrossEntropyLoss(), device=device)
    dtype = DTYPES[args.dtype]

    batch_size: int
    if args.batch_size != "auto":
        batch_size = args.batch_size
    else:
        probe_opt = torch.optim.SGD(model.parameters(), lr=0.0)
        probe_step = autocast_step(probe_opt, dtype=dtype)
        cap = max(8, min(1024, n_train // (world * 8)) // 8 * 8)
        found = _find_batch_size(model, loss_fn, probe_step, device, cap)
        # Every rank must use the same size: take the smallest any rank found.
        batch_size = int(all_reduce([float(found)], device, world, op="min")[0])

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
    steps_per_epoch = math.ceil(micro_steps / ACCUMULATE)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(steps_per_epoch))
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
    # FLOPs of one micro-batch, counted once on the example batch (scaled per sample).
    flops = count_flops(lambda x, y: loss_fn(unwrap(model)(x), y), *example, model=unwrap(model))
    del example
    # Throughput: the optimizer steps are the autocast_step's windows; a window of the
    # rolling figures is one epoch, read at each epoch's end (all ranks combined).
    meter = speed_report(
        "train",
        samples=len,
        flops=flops,
        every=None,
        window=math.ceil(micro_steps / ACCUMULATE),
        file=None,
    )
    metered_step = meter(train_step)

    record_memory = args.plot is not None
    step_losses: list[torch.Tensor] = []
    step_memory: list[int] = []
    epochs: list[EpochStats] = []
    batches = prefetch(loader, device)
    # --resume DIR: a checkpoint every epoch (and on SIGTERM/SIGUSR1); a run started again
    # on the same directory continues from the newest complete one.
    ckpt = (
        Checkpointer(
            args.resume,
            step=step,
            loader=batches,
            every=max(1, micro_steps // ACCUMULATE),
            keep=2,
        )
        if args.resume is not None
        else None
    )
    epoch_numbers = ckpt.epochs(args.epochs) if ckpt is not None else range(args.epochs)
    mfu_reason: str | None = None
    for epoch_index in epoch_numbers:
        epoch = epoch_index + 1
        done = ckpt.position.batch if ckpt is not None else 0  # a resumed epoch's batches
        progress = Progress(
            micro_steps - done,
            f"epoch {epoch}/{args.epochs}",
            enabled=main_rank,
            bar=not args.no_progress,
        )
        steps_before, skipped_before = step.steps, step.skipped_steps
        epoch_losses: list[torch.Tensor] = []
        synchronize(device)
        start = time.perf_counter()
        with memory_report(f"epoch {epoch}", device=device, file=None) as mem:
            source = ckpt.batches() if ckpt is not None else batches
            for i, (images, labels) in enumerate(source, start=done + 1):
                result = metered_step(images, labels)
                epoch_losses.append(result.loss)
                if record_memory:
                    step_memory.append(memory_snapshot(device).allocated)
                if i % 10 == 0 or i == micro_steps:  # .item() syncs: not on every step
                    elapsed = time.perf_counter() - start
                    progress.update(
                        min(10 if i % 10 == 0 else i % 10, i - done),
                        loss=float(result.loss),
                        samples_per_s=(i - done) * batch_size * world / elapsed,
                    )
            step.flush()  # a partial accumulation window still updates the weights
            synchronize(device)
        seconds = time.perf_counter() - start
        meter.flush()  # this epoch's figures, every rank's combined (a collective)
        speed = (meter.combined or meter.summary()).recent
        mfu_reason = speed.mfu_reason
        losses = torch.stack(epoch_losses).float().cpu()  # one sync per epoch
        step_losses.extend(losses)
        train_loss = all_reduce([float(losses.mean())], device, world)[0] / world
        val_loss, val_acc = evaluate(unwrap(model), loss_fn, step, val_x, val_y, world)
        stats = EpochStats(
            epoch=epoch,
            train_loss=train_loss,
            val_loss=val_loss,
            val_accuracy=val_acc,
            samples_per_s=(micro_steps - done) * batch_size * world / seconds,
            seconds=seconds,
            optimizer_steps=step.steps - steps_before,
            skipped_steps=step.skipped_steps - skipped_before,
            peak_memory=mem.peak_allocated,
            memory_kind="rss" if device.type == "cpu" else "allocated",
            step_time=speed.step_time,
            tflops=speed.tflops,
            mfu=speed.mfu,
        )
        epochs.append(stats)
        progress.close(
            f"train loss {stats.train_loss:.4f}, held-out loss {val_loss:.4f}, "
            f"accuracy {val_acc:.1%}, {stats.samples_per_s:,.0f} samples/s, "
            f"{seconds:.1f} s"
        )

    resumed_from = None
    if ckpt is not None:
        ckpt.close()
        resumed_from = str(ckpt.resumed_from) if ckpt.resumed_from is not None else None
    if not epochs:  # resumed from a finished run: nothing left to train
        _, accuracy = evaluate(unwrap(model), loss_fn, step, val_x, val_y, world)
        final_accuracy = accuracy
    else:
        final_accuracy = epochs[-1].val_accuracy
    k = max(1, min(8, micro_steps // 4))
    all_losses = [float(v) for v in step_losses] or [math.nan]
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
        final_accuracy=final_accuracy,
        epochs=epochs,
        step_losses=all_losses,
        step_memory=step_memory,
        resumed_from=resumed_from,
        mfu_reason=mfu_reason,
    )
