"""In the middle of an accumulation window FSDP2 keeps the gradients inside itself: the
step's ``state_dict``, its ``load_state_dict`` and ``preserve_state`` refuse to work
there, rather than save or restore nothing, and work at a window's boundary."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launcher_env import clean_launcher_env, free_port, torchrun_env  # noqa: F401 (autouse fixture)
from small_models import Net
from torch import nn

import cudakit.parallel as cp


def _fsdp2_step() -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """An FSDP2 model (one rank), its optimizer, an accumulate=2 step and its decorated call."""
    import torch.nn.functional as F

    from cudakit import autocast_step

    torch.manual_seed(0)
    model = cp.parallelize(Net(), "fsdp", timeout=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autocast_step(opt, model=model, dtype="fp32", accumulate=2)
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    train = step(lambda: F.cross_entropy(model(x), y))
    return model, opt, step, train


def test_fsdp2_mid_window_checkpoint_is_refused_not_silently_empty(one_rank: None) -> None:
    model, _, step, train = _fsdp2_step()
    boundary = step.state_dict()  # position 0: fine
    train()
    assert step.position == 1
    with pytest.raises(RuntimeError, match=r"state_dict\(\).*FSDP2.*flush\(\)"):
        step.state_dict()
    mid = dict(boundary, position=1, grads=[None] * len(list(model.parameters())))
    with pytest.raises(ValueError, match=r"mid-window.*FSDP2"):
        step.load_state_dict(mid)
    assert step.position == 1
    assert train().stepped
    step.load_state_dict(step.state_dict())  # at a boundary: round trip


def test_preserve_state_says_when_fsdp2_keeps_a_blocks_gradients(one_rank: None) -> None:
    from cudakit import preserve_state

    model, opt, step, train = _fsdp2_step()
    refused = pytest.raises(RuntimeError, match=r"FSDP2 keeps their gradients inside itself")
    with refused, preserve_state(model, opt, extra=(step,)):
        train()  # half a window, without gradient sync
    with preserve_state(model, opt, extra=(step,)):
        train()
        train()  # a whole window: nothing left inside FSDP2
    assert step.position == 0
