"""A multi-rank training script for the checkpoint tests, started by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ckpt_dist_script.py \
        train --dir D --out O --strategy fsdp [--kill-at K] [--sigterm-at K]
    ... ckpt_dist_script.py load --dir D --out O --strategy fsdp [--path P]

``train`` runs 2 epochs of a small MLP (dropout, AdamW, a scheduler, accumulate=2,
clipping) over ``distributed_loader`` with a ``Checkpointer`` (every 2 windows), and
writes the full weights and optimizer state and every loss to ``O`` on rank 0.
``--kill-at K`` SIGKILLs rank 1 when batch K is handed out, on torchrun's first attempt
only; ``--sigterm-at K`` sends rank 1 a SIGTERM there; ``--async-save`` writes in the
background. ``load`` resumes (or loads checkpoint ``--path``) and writes what it
loaded; a CheckpointError is printed by each rank, which exits with status 3.
``--stepped`` steps the optimizer once before the load; ``--report`` prints, on each
rank, the bytes the load copied to host memory to put the run back, and after a failed
load whether each rank's shards, optimizer state and RNG are as they were.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
from typing import Any

import torch
import torch.nn.functional as F

import cudakit
import cudakit.parallel as cp


def build(strategy: str, lr: float = 1e-2) -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1),
    )  # fmt: skip
    model = cp.parallelize(net, strategy) if strategy != "none" else net
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    step = cudakit.autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=2, scheduler=sched, max_grad_norm=1.0
    )
    return model, opt, sched, step


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(4)
    return torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    )


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd}


def train(args: argparse.Namespace) -> None:
    model, opt, _sched, step = build(args.strategy)

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)

    loader = cp.distributed_loader(data(), batch_size=4, shuffle=True)
    ckpt = cudakit.Checkpointer(
        args.dir, step=train_step, loader=loader, every=2, keep=2, async_save=args.async_save
    )
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    losses: dict[int, float] = {}
    for _ in ckpt.epochs(2):
        for x, y in ckpt.batches():
            total = ckpt.position.total
            if cp.rank() == 1 and total == args.kill_at and first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
            if cp.rank() == 1 and total == args.sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)
            losses[total] = float(train_step(x, y).loss)
    ckpt.close()
    state = full_state(model, opt)
    if cp.rank() == 0:
        torch.save(
            {"state": state, "losses": losses, "resumed_from": str(ckpt.resumed_from)}, args.out
        )


def _local_state(model: Any, opt: Any) -> list[tuple[Any, torch.Tensor]]:
    """Each shard and optimizer state tensor of this rank: the object and a copy."""
    tensors = [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
    local = [getattr(t, "to_local", lambda t=t: t)() for t in tensors]
    return [(t, x.clone()) for t, x in zip(tensors, local, strict=True)]


def _unchanged(before: list[tuple[Any, torch.Tensor]], model: Any, opt: Any) -> bool:
    after = _local_state(model, opt)
    return len(after) == len(before) and all(
        a is b and torch.equal(x, y) for (a, x), (b, y) in zip(before, after, strict=True)
    )


def _say(line: str) -> None:
    # One write, under PIPE_BUF: the ranks share the pipe, and print's two writes
    # (the text, then the newline) could interleave with the other rank's line.
    sys.stdout.flush()
    os.write(1, line.encode())


def load(args: argparse.Namespace) -> None:
    import cudakit.checkpoint._rollback as rollback

    model, opt, _, step = build(args.strategy, lr=0.5)  # another lr: the checkpoint's wins
    if args.stepped:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    copied = [0]
    real_to_host = rollback._to_host

    def counting(tree: Any) -> Any:
        out = real_to_host(tree)
        if isinstance(out, torch.Tensor):
            copied[0] += out.numel() * out.element_size()
        return out

    rollback._to_host = counting  # type: ignore[assignment]
    before = _local_state(model, opt) if args.report else []
    rng = torch.get_rng_state()
    ckpt = cudakit.Checkpointer(args.dir, step=step, preemption=False)
    try:
        position = ckpt.load(args.path) if args.path else ckpt.resume()
    except cudakit.CheckpointError as exc:
        _say(f"rank {cp.rank()} stopped: {type(exc).__name__}: {exc}\n")
        if args.report:
            same = _unchanged(before, model, opt) and torch.equal(rng, torch.get_rng_state())
            _say(f"rank {cp.rank()} unchanged: {same}\n")
        ckpt.close()
        raise SystemExit(3) from None
    if args.report:
        _say(f"rank {cp.rank()} copied to host: {copied[0]} bytes\n")
    ckpt.close()
    state = full_state(model, opt)
    if cp.rank() == 0:
        torch.save({"state": state, "position": position}, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "load"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--sigterm-at", type=int, default=-1)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--path", default=None, help="load: this checkpoint, not the newest")
    parser.add_argument("--stepped", action="store_true", help="load: step once before")
    parser.add_argument("--report", action="store_true", help="load: host copies, rollback")
    args = parser.parse_args()
    with cudakit.process_group(timeout=datetime.timedelta(seconds=60)):
        (train if args.mode == "train" else load)(args)


if __name__ == "__main__":
    main()
