"""warm-up leaves loaders and steps alone: a distributed loader's epoch, a step's schedulers
and optimizers; the meta device refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import cudakit.parallel as cp
from cudakit.amp import autocast_step
from cudakit.exceptions import DeviceError
from cudakit.warmup import example_batch, warmup


def test_example_batch_keeps_a_distributed_loaders_epoch() -> None:
    ds = torch.utils.data.TensorDataset(torch.arange(16.0))
    ref = [b[0].tolist() for b in cp.distributed_loader(ds, batch_size=4, seed=0)]
    loader = cp.distributed_loader(ds, batch_size=4, seed=0)
    example_batch(loader)
    assert loader.epoch == 0
    assert [b[0].tolist() for b in loader] == ref


def test_warmup_with_a_step_leaves_its_schedulers_and_optimizers_alone() -> None:
    def make() -> tuple[Any, ...]:
        torch.manual_seed(0)
        m = nn.Linear(4, 1)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / (1 + e))
        step = autocast_step(opt, dtype=torch.float32, scheduler=sched)
        return m, opt, sched, step, step(lambda mm, x: mm(x).pow(2).mean())

    x = torch.randn(8, 4)
    m, opt, sched, step, fn = make()
    warmup(m, x, loss_fn=fn, amp=step, steps=3)
    assert sched.last_epoch == 0
    assert opt.state_dict()["state"] == {}
    twin_m, _, twin_sched, _, twin_fn = make()
    for _ in range(4):
        fn(m, x)
        twin_fn(twin_m, x)
    assert torch.equal(m.weight, twin_m.weight)
    assert sched.get_last_lr() == twin_sched.get_last_lr()


def test_warmup_on_the_meta_device_is_refused() -> None:
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with pytest.raises(DeviceError, match=r"warmup\(device='meta'\): the meta device"):
        warmup(model, torch.randn(3, 2), device="meta")
    assert torch.equal(model.weight, before)
