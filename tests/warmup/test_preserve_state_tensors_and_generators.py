"""preserve_state(extra=...) also puts back loose tensors and torch.Generator objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cudakit.warmup import preserve_state, warmup


def test_a_loose_tensor_gets_its_values_grad_and_requires_grad_back() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    x.grad = torch.full((2, 3), 5.0)
    grad = x.grad
    with preserve_state(extra=(x,)):
        (x * 2).sum().backward()  # adds into x.grad in place
        with torch.no_grad():
            x.mul_(3)
        x.requires_grad_(False)
    assert x.requires_grad
    assert torch.equal(x.detach(), torch.ones(2, 3))
    assert x.grad is grad
    assert torch.equal(grad, torch.full((2, 3), 5.0))


def test_a_tensor_without_grad_gets_none_back() -> None:
    x = torch.ones(3, requires_grad=True)
    with preserve_state(extra=(x,)):
        x.sum().backward()
    assert x.grad is None


def test_a_generator_of_ones_own_is_put_back() -> None:
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    with preserve_state(extra=(g,)):
        torch.randn(10, generator=g)
    assert torch.equal(g.get_state(), state)
    assert torch.equal(
        torch.randn(4, generator=g), torch.randn(4, generator=torch.Generator().manual_seed(7))
    )


def test_warmup_puts_back_a_generator_its_loss_draws_from() -> None:
    model = nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)
    state = g.get_state()

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch + torch.randn(batch.shape, generator=g)).sum()

    warmup(model, torch.ones(2, 3), loss_fn=loss_fn, steps=2, extra=(g,))
    assert torch.equal(g.get_state(), state)


@pytest.mark.parametrize("bad", [object(), 3, "sched"])
def test_other_extras_are_still_refused_by_name(bad: object) -> None:
    with pytest.raises(TypeError, match=r"preserve_state\(extra=\.\.\.\)") as info:
        preserve_state(extra=(bad,))
    if not isinstance(bad, str):
        assert "tensors or torch.Generator objects" in str(info.value)


def test_a_non_leaf_tensor_is_put_back_without_a_warning() -> None:
    base = torch.ones(3, requires_grad=True)
    y = base * 2  # not a leaf: no .grad of its own to keep
    with preserve_state(extra=(y,)), torch.no_grad():
        y.add_(5)
    assert torch.equal(y.detach(), torch.full((3,), 2.0))
