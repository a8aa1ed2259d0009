"""A small training run with every kind of state a checkpoint must carry, for the tests.

Dropout and a shuffling loader draw from the global RNG, AdamW and a scheduler carry
state, and ``autocast_step`` accumulates; ``crash_at`` stops the run (as a crash
would) when the loader hands out that batch, before the step runs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import cudakit


class Crash(Exception):
    """Stands for a process killed mid-run."""


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    )  # fmt: skip


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 2, generator=g))


def run(
    directory: Path | None,
    *,
    epochs: int = 2,
    accumulate: int = 2,
    every: int | None = 1,
    crash_at: int | None = None,
    noise: int | None = None,
    async_save: bool = False,
    keep: int | None = None,
    loader_generator: bool = False,
    kind: str = "plain",
) -> dict[str, Any]:
    """Train; returns the final weights, optimizer state, the losses by batch and the ckpt."""
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    step = cudakit.autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=accumulate, scheduler=sched,
        max_grad_norm=1.0,
    )  # fmt: skip

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    gen = torch.Generator().manual_seed(11) if loader_generator else None
    loader: Any = DataLoader(make_data(), batch_size=4, shuffle=True, generator=gen)
    if kind == "distributed":  # one rank of one: the sampler shuffles by seed and epoch
        loader = cudakit.distributed_loader(make_data(), batch_size=4, seed=5)
    elif kind == "prefetch":
        loader = cudakit.prefetch(loader, "cpu")
    losses: dict[int, float] = {}
    if directory is None:  # the hand-written loop, no checkpointer (a DistributedLoader
        # counts its epochs by itself; a DataLoader's order comes from the global RNG)
        for _ in range(epochs):
            for x, y in loader:
                losses[len(losses) + 1] = float(train_step(x, y).loss)
        return {"model": model, "opt": opt, "losses": losses, "step": step, "sched": sched}
    ckpt = cudakit.Checkpointer(
        directory, step=train_step, loader=loader, every=every, keep=keep,
        async_save=async_save, preemption=False,
    )  # fmt: skip
    if noise is not None and cudakit.find_latest(directory) is not None:
        # A new process is elsewhere in its generators than the saved run was.
        torch.manual_seed(noise)
        random.seed(noise)
        if gen is not None:
            gen.manual_seed(noise)
    for _ in ckpt.epochs(epochs):
        for x, y in ckpt.batches():
            total = ckpt.position.total
            if crash_at is not None and total == crash_at:
                raise Crash(total)
            losses[total] = float(train_step(x, y).loss)
    ckpt.close()
    return {
        "model": model, "opt": opt, "losses": losses, "step": step, "sched": sched, "ckpt": ckpt,
    }  # fmt: skip


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Weights and optimizer state equal bit for bit."""
    for (ka, va), (kb, vb) in zip(
        a["model"].state_dict().items(), b["model"].state_dict().items(), strict=True
    ):
        if ka != kb or not torch.equal(va, vb):
            return False
    sa, sb = a["opt"].state_dict(), b["opt"].state_dict()
    if sa["param_groups"] != sb["param_groups"]:
        return False
    for key in sa["state"]:
        for name, value in sa["state"][key].items():
            if not torch.equal(value, sb["state"][key][name]):
                return False
    return a["sched"].state_dict() == b["sched"].state_dict()
