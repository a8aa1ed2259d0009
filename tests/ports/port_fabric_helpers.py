"""What the test_port_fabric_*.py modules share (ports of Lightning Fabric tests).

:func:`fabric_checks` is the rank function of test_port_fabric_distributed.py (module
level, so that the processes ``cudakit.launch`` spawns can import it); the parent
compares its results with :func:`single_reference`, trained in one process.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cudakit.parallel as cp
from cudakit.amp import autocast_step

#: (accumulate, max_grad_norm) of the DDP parity checks.
PARITY_CASES = ((1, None), (2, None), (2, 0.05))
LR = 0.1


def net() -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four global batches of 4 samples; rank r of 2 trains on samples 2r and 2r + 1."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]


def single_reference(
    accumulate: int = 1, clip: float | None = None
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Whole-batch training in one process: what DDP and FSDP over 2 ranks must match."""

    model = net()
    step = autocast_step(
        torch.optim.SGD(model.parameters(), lr=LR),
        dtype="fp32",
        accumulate=accumulate,
        max_grad_norm=clip,
    )
    fn = step(lambda x, y: F.mse_loss(model(x), y))
    for x, y in data():
        fn(x, y)
    return [p.detach().clone() for p in model.parameters()], model.state_dict()


def _counting_allreduce(model: nn.Module, calls: list[int]) -> None:
    """A DDP comm hook that averages as DDP does and counts the bucket all-reduces."""
    world = dist.get_world_size()

    # Unannotated: DDP checks the annotations, which `from __future__ import annotations`
    # turns into strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        calls[0] += 1
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / world)

    model.register_comm_hook(None, hook)


def _ddp_parity(accumulate: int, clip: float | None, explicit: bool = False) -> dict[str, Any]:
    """test_ddp_integration parity and no_backward_sync (decorated or explicit form)."""

    model = cp.parallelize(net(), "ddp")
    r = dist.get_rank()
    calls = [0]
    _counting_allreduce(model, calls)
    step = autocast_step(
        torch.optim.SGD(model.parameters(), lr=LR),
        model=model,
        dtype="fp32",
        accumulate=accumulate,
        max_grad_norm=clip,
    )
    fn = step(lambda x, y: F.mse_loss(model(x), y))
    for x, y in data():
        xr, yr = x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]
        if explicit:
            with step:
                loss = F.mse_loss(model(xr), yr)
            step.backward(loss)
        else:
            fn(xr, yr)
    return {
        "params": [p.detach().clone() for p in cp.unwrap(model).parameters()],
        "allreduces": calls[0],
        "steps": step.steps,
        "sd_keys": list(cp.state_dict(model)),
    }


def _ddp_save_load(tmp: Path) -> list[bool]:
    """test_ddp.py::test_ddp_module_state_dict: checkpoints load with or without the wrapper."""

    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    if cp.is_main_process():
        torch.save(cp.state_dict(model), tmp / "before.pt")
    wrapped = cp.parallelize(model, "ddp")
    if cp.is_main_process():
        torch.save(cp.state_dict(wrapped), tmp / "after.pt")
    dist.barrier()

    def same(m: nn.Module) -> bool:
        return all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))

    ok = []
    for name in ("before.pt", "after.pt"):
        plain = nn.Linear(2, 2)
        cp.load_state_dict(plain, torch.load(tmp / name))
        ok.append(same(plain))
        cp.load_state_dict(wrapped, torch.load(tmp / name))
        ok.append(same(wrapped))
    plain = nn.Linear(2, 2)
    cp.load_state_dict(plain, wrapped.state_dict())  # keys prefixed with "module."
    ok.append(same(plain))
    return ok


def _main_process_first(tmp: Path, *, wait_for_rank1: bool) -> list[str]:
    """test_fabric.py::test_rank_zero_first: the other ranks enter after rank 0 is done.

    Rank 0 writes "0", then "0done" as it leaves the block; rank 1 writes "1". With
    ``wait_for_rank1`` rank 0 waits inside the block for rank 1's line (up to 30 s), so
    the outcome is the same every run: ranks not held back give "0done" last, ranks held
    back (after the 30 s) give ["0", "0done", "1"]. Without it rank 0 lingers 0.2 s, for
    rank 1 to barge in if it were not held back.
    """

    tmp.mkdir(exist_ok=True)
    order = tmp / "order.txt"
    with cp.main_process_first():
        with order.open("a") as f:
            f.write(f"{cp.rank()}\n")
        if cp.rank() == 0:
            deadline = time.monotonic() + (30 if wait_for_rank1 else 0.2)
            while time.monotonic() < deadline:
                if wait_for_rank1 and "1" in order.read_text().split():
                    break
                time.sleep(0.01)
            with order.open("a") as f:
                f.write("0done\n")
    return order.read_text().split()


def _ddp_extra_kwargs() -> dict[str, Any]:
    """test_ddp.py::test_ddp_extra_kwargs: DDP options reach the wrapper; gloo on the CPU."""

    model = cp.parallelize(net(), "ddp", find_unused_parameters=True)
    return {
        "is_ddp": isinstance(model, nn.parallel.DistributedDataParallel),
        "find_unused": model.find_unused_parameters,
        "device_ids": model.device_ids,
        "backend": dist.get_backend(),
    }


def _ddp_clip_bf16() -> dict[str, float]:
    """test_ddp_integration.py::test_clip_gradients (norm, CPU, bf16-mixed)."""

    torch.manual_seed(0)
    plain = nn.Linear(32, 2, bias=False)
    plain.weight.data.fill_(0.01)
    model = cp.parallelize(plain, "ddp")
    target = 0.1 * math.sqrt(64) / 2  # half the unclipped norm
    step = autocast_step(
        torch.optim.SGD(model.parameters(), lr=1.0),
        model=model,
        dtype="bf16-mixed",
        max_grad_norm=target,
    )
    w0 = plain.weight.detach().clone()
    batch = torch.full((1, 32), 0.1)
    step(lambda: model(batch).float().sum())()
    assert plain.weight.grad is not None
    return {
        "grad": float(torch.linalg.vector_norm(plain.weight.grad.float())),
        "update": float(torch.linalg.vector_norm(w0 - plain.weight.detach())),
        "target": target,
    }


def _fsdp_parity() -> dict[str, Any]:
    """test_fsdp_integration: FSDP with accumulation and clipping matches one process."""

    model = cp.parallelize(net(), "fsdp")
    r = dist.get_rank()
    step = autocast_step(
        torch.optim.SGD(model.parameters(), lr=LR),
        model=model,
        dtype="fp32",
        accumulate=2,
        max_grad_norm=0.5,
    )
    fn = step(lambda x, y: F.mse_loss(model(x), y))
    for x, y in data():
        fn(x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2])
    return {"steps": step.steps, "sd": {k: v.clone() for k, v in cp.state_dict(model).items()}}


def fabric_checks(tmp: str) -> dict[str, Any]:
    """Rank function: every two-rank check of test_port_fabric_distributed.py."""

    torch.set_num_threads(1)  # two ranks share the machine's cores
    root = Path(tmp)
    out: dict[str, Any] = {}
    # Before any process group: main_process_first cannot order the ranks (it warns).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["first_no_group"] = _main_process_first(root / "no_group", wait_for_rank1=True)
    out["first_no_group_warnings"] = [str(w.message) for w in caught]
    with cp.process_group(timeout=60):
        _main_process_first(root / "group", wait_for_rank1=False)
        dist.barrier()  # every rank has written its line
        out["first"] = (root / "group" / "order.txt").read_text().split()
        out["parity"] = {case: _ddp_parity(*case) for case in PARITY_CASES}
        out["explicit"] = _ddp_parity(2, None, explicit=True)
        out["save_load"] = _ddp_save_load(root)
        out["kwargs"] = _ddp_extra_kwargs()
        out["clip_bf16"] = _ddp_clip_bf16()
        out["fsdp"] = _fsdp_parity()
    return out
