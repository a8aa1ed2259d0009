"""Calls made in the wrong order are refused before they change anything: ``flush()``
between ``with step:`` and ``step.backward(loss)``, ``load_state_dict()`` inside the
step function or the block, and the same loss passed to ``step.backward()`` twice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cudakit.amp import autocast_step

torch.set_num_threads(1)


def _setup(accumulate: int = 2) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    step = autocast_step(
        torch.optim.SGD(m.parameters(), lr=0.1), dtype=torch.float32, accumulate=accumulate
    )
    return m, step


def _grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def test_flush_between_the_block_and_its_backward_is_refused() -> None:
    m, step = _setup()
    x = torch.ones(2, 4)
    step.backward(m(x).sum())
    with step:
        loss = m(x).sum()
    before = _grads(m)
    with pytest.raises(
        RuntimeError,
        match=r"AutocastStep\.flush\(\) called between `with step:` and step\.backward\(loss\)",
    ):
        step.flush()
    assert step.position == 1
    assert all(torch.equal(a, p.grad) for a, p in zip(before, m.parameters(), strict=True))  # type: ignore[arg-type]
    assert step.backward(loss).stepped  # the micro-step goes on as it was


def test_load_state_dict_inside_the_step_function_is_refused() -> None:
    m, step = _setup()
    state = step.state_dict()

    @step
    def fn(x: torch.Tensor) -> torch.Tensor:
        step.load_state_dict(state)
        return m(x).sum()

    with pytest.raises(
        RuntimeError, match=r"AutocastStep\.load_state_dict\(\) called inside the step function"
    ):
        fn(torch.ones(2, 4))
    assert step.position == 0


def test_load_state_dict_inside_the_block_or_before_its_backward_is_refused() -> None:
    m, step = _setup()
    x = torch.ones(2, 4)
    step.backward(m(x).sum())
    state = {**step.state_dict(), "position": 0, "grads": [], "window_losses": []}
    with step:
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) called inside .*`with step:`"):
            step.load_state_dict(state)
        loss = m(x).sum()
    with pytest.raises(RuntimeError, match=r"between `with step:` and step\.backward\(loss\)"):
        step.load_state_dict(state)
    assert step.position == 1
    assert step.backward(loss).stepped


def test_the_same_loss_twice_is_refused_before_gradients_change() -> None:
    m, step = _setup(accumulate=3)
    loss = m(torch.ones(2, 4)).sum()
    step.backward(loss)
    before = _grads(m)
    with pytest.raises(
        RuntimeError, match=r"AutocastStep\.backward\(\) got the loss tensor of the previous call"
    ):
        step.backward(loss)
    assert step.position == 1
    assert all(torch.equal(a, p.grad) for a, p in zip(before, m.parameters(), strict=True))  # type: ignore[arg-type]


def test_a_step_function_returning_one_cached_loss_is_refused() -> None:
    m, step = _setup(accumulate=3)
    cache = [m(torch.ones(2, 4)).sum()]
    fn = step(lambda: cache[0])
    fn()
    with pytest.raises(RuntimeError, match="got the loss tensor of the previous call"):
        fn()
