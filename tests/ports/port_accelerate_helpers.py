"""What the test_port_accelerate_*.py modules share (ports of Hugging Face accelerate tests).

The model and data follow accelerate.test_utils.training; :func:`accelerate_checks` is
the rank function of test_port_accelerate_distributed.py (module level, so that the
processes ``cudakit.launch`` spawns can import it).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cudakit.parallel as cp
from cudakit.amp import autocast_step

#: (dataset length, drop_last) for the two-rank distributed_loader check; batch size 3.
LOADER_CASES = ((21, False), (21, True), (2, False))


class RegressionModel(torch.nn.Module):
    """accelerate.test_utils.training.RegressionModel: ``y = a * x + b``."""

    def __init__(self, a: float = 0.0, b: float = 0.0) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a))
        self.b = torch.nn.Parameter(torch.tensor(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


def regression_data(length: int = 80, seed: int = 42) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """accelerate's RegressionDataset (``y = 2x + 3 + noise``) in batches of 16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, generator=g)
    y = 2 * x + 3 + 0.1 * torch.randn(length, generator=g)
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, length, 16)]


def _grads_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        p.grad is not None and q.grad is not None and torch.allclose(p.grad, q.grad)
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _gradient_accumulation_sync(accumulate: int) -> list[tuple[bool, bool]]:
    """test_sync.py::test_distributed_sync / test_gradient_accumulation under DDP.

    Each rank trains on its half of every global batch; a single-process reference
    trains on the whole batch. Per micro-step: (stepped, grads equal the reference's).
    """

    torch.manual_seed(0)
    ref = RegressionModel(0.5, -0.3)
    ddp = cp.parallelize(copy.deepcopy(ref), "ddp", device="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    step = autocast_step(
        torch.optim.SGD(ddp.parameters(), lr=0.0), model=ddp, accumulate=accumulate, dtype="fp32"
    )
    fn = step(lambda x, y: F.mse_loss(ddp(x), y))
    batches = regression_data()
    log = []
    for it, (x, y) in enumerate(batches):
        if it % accumulate == 0:
            ref.zero_grad(set_to_none=True)
        (F.mse_loss(ref(x), y) / accumulate).backward()
        r = fn(x[rank::world], y[rank::world])
        log.append((bool(r.stepped), _grads_equal(ref, ddp.module)))
    # The partial last window: cudakit averages its pending micro-steps (over the ranks too).
    pending = len(batches) % accumulate
    for p in ref.parameters():
        assert p.grad is not None
        p.grad.mul_(accumulate / pending)
    r = fn.flush()
    log.append((bool(r is not None and r.stepped), _grads_equal(ref, ddp.module)))
    return log


def _nan_on_one_rank() -> list[tuple[bool, list[float]]]:
    """One rank's loss is NaN: every rank skips that step, so the replicas never diverge."""

    torch.manual_seed(0)
    ddp = cp.parallelize(RegressionModel(0.5, -0.3), "ddp", device="cpu")
    step = autocast_step(torch.optim.SGD(ddp.parameters(), lr=0.1), model=ddp, dtype="fp32")
    fn = step(lambda x, y, k: F.mse_loss(ddp(x), y) * k)
    out = []
    for it in range(3):
        k = float("nan") if (it == 1 and dist.get_rank() == 1) else 1.0
        r = fn(torch.randn(4), torch.randn(4), k)
        out.append((bool(r.skipped), [p.item() for p in ddp.parameters()]))
    return out


def _loader_shards(n: int, batch_size: int, drop_last: bool) -> tuple[int, list[Any], list[Any]]:
    """(len, epoch 0's batches, epoch 1's batches) of this rank's distributed_loader."""

    loader = cp.distributed_loader(
        list(range(n)), batch_size=batch_size, shuffle=True, seed=1, drop_last=drop_last
    )
    return len(loader), [b.tolist() for b in loader], [b.tolist() for b in loader]


def accelerate_checks() -> dict[str, Any]:
    """Rank function: every two-rank check of test_port_accelerate_distributed.py."""

    torch.set_num_threads(1)  # two ranks share the machine's cores
    with cp.process_group(backend="gloo", timeout=60):
        return {
            "sync": _gradient_accumulation_sync(accumulate=2),
            "nan": _nan_on_one_rank(),
            "loaders": {case: _loader_shards(case[0], 3, case[1]) for case in LOADER_CASES},
        }
