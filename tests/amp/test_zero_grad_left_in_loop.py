"""An ``optimizer.zero_grad()`` left in the loop with ``accumulate > 1`` would wipe the
window's earlier micro-steps: the step notices that the window's gradients vanished
between micro-steps and raises before it runs the forward. Zeroing in place
(``set_to_none=False``) keeps the tensors and is not seen (values are never read)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from cudakit.amp import autocast_step

torch.set_num_threads(1)

MESSAGE = (
    r"AutocastStep: the gradients this window accumulated over its first 1 of 3 micro-steps "
    r"were cleared since the last one: is an "
    r"optimizer\.zero_grad\(\) or model\.zero_grad\(\) left in the loop\?"
)


def _setup(accumulate: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = autocast_step(opt, model=m, dtype=torch.float32, accumulate=accumulate)
    return m, opt, step, step(lambda x: m(x).pow(2).mean())


CLEARS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "optimizer.zero_grad()": lambda m, opt: opt.zero_grad(),
    "model.zero_grad()": lambda m, opt: m.zero_grad(),
}


@pytest.mark.parametrize("clear", list(CLEARS))
def test_a_zero_grad_between_micro_steps_is_refused_before_the_forward(clear: str) -> None:
    m, opt, step, fn = _setup()
    x = torch.randn(6, 4)
    CLEARS[clear](m, opt)
    fn(x)  # the first micro-step of a window: clearing there is harmless
    CLEARS[clear](m, opt)
    stats = m[1].running_mean.clone()
    with pytest.raises(RuntimeError, match=MESSAGE):
        fn(x)
    assert step.position == 1  # the call changed nothing
    assert torch.equal(m[1].running_mean, stats)  # its forward did not run


def test_the_explicit_form_is_refused_in_backward() -> None:
    m, opt, step, _ = _setup()
    x = torch.randn(6, 4)
    with step:
        loss = m(x).pow(2).mean()
    step.backward(loss)
    opt.zero_grad()
    with step:
        loss = m(x).pow(2).mean()
    with pytest.raises(RuntimeError, match=MESSAGE):
        step.backward(loss)
    assert step.position == 1
    assert all(p.grad is None for p in m.parameters())  # backward did not run


def test_zero_grad_at_each_window_start_is_fine() -> None:
    _m, opt, step, fn = _setup(accumulate=2)
    x = torch.randn(6, 4)
    for _ in range(3):
        if step.position == 0:
            opt.zero_grad()
        fn(x)
        fn(x)
    assert step.steps == 3


def test_a_mid_window_resume_is_not_taken_for_a_clear() -> None:
    _m, _opt, step, fn = _setup()
    x = torch.randn(6, 4)
    fn(x)
    state = step.state_dict()
    step.load_state_dict(state)  # the gradients come back as new tensors
    fn(x)
    assert fn(x).stepped


def test_gradients_replaced_between_micro_steps_are_refused() -> None:
    m, _opt, _step, fn = _setup()
    x = torch.randn(6, 4)
    fn(x)
    m[0].weight.grad = m[0].weight.grad.clone()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="were replaced by other tensors since the last one"):
        fn(x)


def test_zeroing_in_place_is_not_seen() -> None:
    """Documented: the step reads no gradient values, so it cannot tell zeros apart."""
    _m, opt, step, fn = _setup()
    x = torch.randn(6, 4)
    fn(x)
    opt.zero_grad(set_to_none=False)
    fn(x)
    assert step.position == 2
