"""cudakit.warmup's no-trace promise, checked the way Lightning Fabric checks its seeding.

Ported from Lightning Fabric tests_fabric/utilities/test_seed.py
(_collect_rng_states / _set_rng_states round trip: torch, numpy and Python RNGs),
applied to preserve_state, warmup, warmed and example_batch.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cudakit.amp import autocast_step
from cudakit.warmup import example_batch, preserve_state, warmed, warmup


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 8), torch.randint(0, 3, (8,))


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _draw() -> tuple[torch.Tensor, Any, float]:
    return torch.rand(3), np.random.rand(3), random.random()


def test_preserve_state_restores_rngs() -> None:
    _seed_all(1)
    expected = _draw()
    _seed_all(1)
    with preserve_state():
        torch.rand(100)
        np.random.rand(50)
        random.random()
    got = _draw()
    assert torch.equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]


def test_warmup_leaves_no_trace() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()  # one real step: optimizer state and grads exist
    opt.step()
    state = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(opt.state_dict())
    grads = [p.grad for p in model.parameters()]
    grad_values = [g.clone() for g in grads if g is not None]
    rng = torch.get_rng_state()
    warmup(model, (x, y), loss_fn=nn.CrossEntropyLoss(), optimizer=opt, steps=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    for p, g in zip(model.parameters(), grad_values, strict=True):
        assert p.grad is not None
        assert torch.equal(p.grad, g)
    after = opt.state_dict()["state"]
    for k, s in opt_state["state"].items():
        for name, t in s.items():
            assert torch.equal(after[k][name], t), (k, name)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training


def test_warmup_with_autocast_step_rolls_back() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    step = autocast_step(opt, dtype="bf16-mixed", accumulate=2, scheduler=sched)
    train = step(lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]))
    state = copy.deepcopy(model.state_dict())
    warmup(model, _batch(), loss_fn=train, optimizer=opt, amp=step, steps=3, extra=(sched,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert (step.steps, step.position) == (0, 0)
    assert sched.last_epoch == 0
    assert opt.param_groups[0]["lr"] == 0.1
    assert all(len(s) == 0 for s in opt.state.values())


def test_warmed_trains_like_the_plain_step() -> None:
    def run(use_warmed: bool) -> tuple[dict[str, torch.Tensor], int]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)

        def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            opt.zero_grad()
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()
            sched.step()

        fn = train_step
        if use_warmed:
            fn = warmed(model=model, optimizer=opt, extra=(sched,), steps=2)(train_step)
        torch.manual_seed(5)
        for _ in range(3):
            fn(_batch())
        return model.state_dict(), sched.last_epoch

    plain, plain_epoch = run(use_warmed=False)
    warm, warm_epoch = run(use_warmed=True)
    assert plain_epoch == warm_epoch == 3
    for k, v in plain.items():
        assert torch.equal(v, warm[k]), k


def test_example_batch_keeps_shuffle_order() -> None:
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(32)), batch_size=4, shuffle=True
    )
    torch.manual_seed(0)
    plain = [b[0].tolist() for b in loader]
    torch.manual_seed(0)
    example_batch(loader)
    assert [b[0].tolist() for b in loader] == plain
