"""Held-out scoring of the demo's model, and the sums over ranks it needs."""

from __future__ import annotations

import torch
from torch import nn

from ..amp import AutocastStep

__all__ = ["all_reduce", "evaluate"]


def all_reduce(
    values: list[float], device: torch.device, world: int, *, op: str = "sum"
) -> list[float]:
    """Sum (or ``op="min"``) ``values`` over the ranks; the values themselves on one process."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    reduce_op = torch.distributed.ReduceOp.MIN if op == "min" else torch.distributed.ReduceOp.SUM
    torch.distributed.all_reduce(t, op=reduce_op)
    return [float(v) for v in t.tolist()]


def evaluate(
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
    loss_sum, correct, count = all_reduce(
        [loss_sum, correct, float(len(images))], images.device, world
    )
    return loss_sum / count, correct / count
