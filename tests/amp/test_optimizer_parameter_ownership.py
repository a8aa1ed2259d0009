"""Which parameters a step's optimizers own: a parameter in two optimizers and an
optimizer outside ``model=`` are refused when the step is built, and a loss that reaches
none of the optimizers' parameters is refused instead of reported as a step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cudakit.amp import autocast_step

torch.set_num_threads(1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def test_a_parameter_in_two_optimizers_is_refused() -> None:
    m = _net()
    a = torch.optim.SGD(m.parameters(), lr=0.1)
    b = torch.optim.AdamW([m[2].weight], lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"autocast_step\(\) got a parameter of shape \(1, 3\) in optimizer 0 \(SGD\) "
        r"and in optimizer 1 \(AdamW\).*once",
    ):
        autocast_step([a, b])


def test_a_parameter_in_two_groups_of_different_optimizers_is_refused() -> None:
    m = _net()
    a = torch.optim.SGD([{"params": [m[0].weight]}, {"params": [m[0].bias]}], lr=0.1)
    b = torch.optim.SGD([{"params": [m[2].weight]}, {"params": [m[0].bias]}], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(3,\) in optimizer 0 \(SGD\) and in optimizer 1"):
        autocast_step([a, b])


def test_an_optimizer_outside_the_model_is_refused() -> None:
    m, other = _net(), nn.Linear(2, 2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)]
    with pytest.raises(
        ValueError,
        match=r"autocast_step\(model=\.\.\.\): optimizer 1 \(SGD\) has none of the model's "
        r"parameters.*outer module",
    ):
        autocast_step(opts, model=m)


def test_optimizers_that_split_the_model_are_fine() -> None:
    m = _net()
    opts = [
        torch.optim.SGD(m[0].parameters(), lr=0.1),
        torch.optim.AdamW(m[2].parameters(), lr=0.1),
    ]
    step = autocast_step(opts, model=m, dtype=torch.float32)
    assert step(lambda: m(torch.ones(2, 4)).pow(2).mean())().stepped


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_loss_that_reaches_no_parameter_is_refused_not_stepped(accumulate: int) -> None:
    m, frozen = _net(), nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    step = autocast_step(opt, dtype=torch.float32, accumulate=accumulate)
    fn = step(lambda x: frozen(x).pow(2).mean())
    before = [p.detach().clone() for p in m.parameters()]
    x = torch.ones(2, 4)
    for _ in range(accumulate - 1):
        assert not fn(x).stepped
    with pytest.raises(
        ValueError, match=r"autocast_step: the window's loss reached none of the optimizers'"
    ):
        fn(x)
    assert step.position == 0  # the window was dropped
    assert step.steps == 0
    assert opt.state_dict()["state"] == {}
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
    # Training the right parameters then works.
    assert step(lambda x: m(x).pow(2).mean())(x).stepped or accumulate > 1


def test_flush_of_a_window_that_reached_no_parameter_is_refused() -> None:
    m, frozen = _net(), nn.Linear(4, 1)
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), accumulate=4)
    step.backward(frozen(torch.ones(2, 4)).pow(2).mean())
    with pytest.raises(ValueError, match="reached none of the optimizers'"):
        step.flush()
    assert step.position == 0
