"""count_flops: FLOPs of real models against the formula, and a pass that leaves no trace."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cudakit.amp import autocast_step
from cudakit.speed import FlopCount, count_flops


def _linear_stack(a: int, b: int, c: int, d: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d))


def test_linear_stack_matches_the_formula() -> None:
    n, a, b, c, d = 8, 16, 32, 24, 4
    model = _linear_stack(a, b, c, d)
    x, y = torch.randn(n, a), torch.randint(0, d, (n,))
    count = count_flops(lambda x, y: F.cross_entropy(model(x), y), x, y, model=model)
    forward = 2 * n * (a * b + b * c + c * d)
    # Backward: every weight's gradient, and the inputs' of all but the first layer
    # (the batch does not require grad).
    backward = forward + 2 * n * (b * c + c * d)
    assert (count.forward, count.backward, count.total) == (forward, backward, forward + backward)
    assert int(count) == count.total
    assert count.example is x


def test_conv_net_matches_the_formula() -> None:
    torch.manual_seed(0)
    n, h, w = 4, 6, 6
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.Flatten(),
        nn.Linear(16 * h * w, 10),
    )
    x = torch.randn(n, 3, h, w)
    count = count_flops(lambda x: net(x).sum(), x, model=net)
    conv1 = 2 * n * h * w * 8 * 3 * 9  # output positions x (c_out x c_in x kernel) x 2
    conv2 = 2 * n * h * w * 16 * 8 * 9
    linear = 2 * n * 16 * h * w * 10
    assert count.forward == conv1 + conv2 + linear
    # conv1: its weight's gradient only; conv2 and the linear layer: input and weight.
    assert count.total == 2 * conv1 + 3 * conv2 + 3 * linear


def test_small_transformer_matches_the_formula() -> None:
    torch.manual_seed(0)
    n, s, d, heads, ff = 2, 8, 16, 2, 32
    layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
    x = torch.randn(n, s, d)
    count = count_flops(lambda x: layer(x).square().mean(), x, model=layer)
    projections = 2 * n * s * d * (3 * d + d)  # q, k, v packed, then the output projection
    mlp = 2 * n * s * d * ff * 2
    attention = 4 * n * s * s * d  # q @ k^T and p @ v over all heads
    assert count.forward == projections + mlp + attention
    weight_grads = projections + mlp
    input_grads = 2 * n * s * d * d + mlp  # the input projection's input is the batch
    # Model FLOPs: attention's backward is twice its forward. The fused kernel also
    # recomputes q @ k^T, a hardware FLOP only.
    assert count.backward == weight_grads + input_grads + 2 * attention
    assert count.recomputed == attention // 2


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    out: list[Any] = [t.clone() for t in model.state_dict().values()]
    out += [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def test_counting_changes_no_weight_grad_buffer_optimizer_state_or_rng() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    model(x).sum().backward()
    opt.step()  # some optimizer state and gradients to keep
    before = _state(model, opt)
    rng, py = torch.get_rng_state(), random.getstate()

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()  # even a function that steps leaves nothing behind
        return loss.detach().requires_grad_()

    count = count_flops(step, x, model=model, optimizer=opt)
    assert count.total > 0
    assert _same(_state(model, opt), before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert random.getstate() == py


def test_autocast_step_function_is_counted_whole_and_put_back() -> None:
    model = _linear_stack(8, 16, 16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    step = autocast_step(opt, model=model, dtype=torch.float32, scheduler=sched)

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    train(x, y)
    before, steps, lr = _state(model, opt), step.steps, sched.get_last_lr()
    count = count_flops(train, x, y)  # the step's model= is used
    plain = count_flops(lambda x, y: F.cross_entropy(model(x), y), x, y, model=model)
    assert count.forward is None
    assert count.backward is None
    assert count.total == plain.total
    assert _same(_state(model, opt), before)
    assert (step.steps, sched.get_last_lr()) == (steps, lr)


def test_keyword_batch_is_the_example() -> None:
    model = nn.Linear(3, 1)
    batch = {"x": torch.randn(2, 3)}
    count = count_flops(lambda *, x: model(x).sum(), model=model, **batch)
    assert count.example is batch["x"]
    assert count.total == 2 * 2 * 3 * 1 * 2  # forward, and the weight's gradient
    assert FlopCount(10, None, None).backward is None


def test_errors() -> None:
    model = nn.Linear(2, 1)
    x = torch.randn(3, 2)
    with pytest.raises(TypeError, match=r"count_flops\(fn=...\) expects a function that"):
        count_flops(3, x, model=model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"count_flops\(model=...\) expects a torch.nn.Module"):
        count_flops(lambda x: model(x).sum(), x, model=model.state_dict())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"count_flops\(optimizer=...\) expects a torch.optim"):
        count_flops(lambda x: model(x).sum(), x, model=model, optimizer=model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"count_flops\(extra=...\) expects a tuple of objects"):
        count_flops(lambda x: model(x).sum(), x, model=model, extra=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"count_flops\(extra=...\) expects objects with state"):
        count_flops(lambda x: model(x).sum(), x, model=model, extra=(3,))
    with pytest.raises(ValueError, match=r"count_flops\(\) needs the model fn runs"):
        count_flops(lambda x: model(x).sum(), x)
    w = model.weight.clone()
    with pytest.raises(TypeError, match=r"runs backward from the loss fn returns.*got Tensor"):
        count_flops(lambda x: model(x), x, model=model)  # logits, not a loss
    with pytest.raises(TypeError, match=r"runs backward from the loss fn returns.*got NoneType"):
        count_flops(lambda x: None, x, model=model)
    assert torch.equal(model.weight, w)
    assert model.weight.grad is None


@pytest.mark.parametrize("form", ["tuple", "dict", "attr"])
def test_loss_forms(form: str) -> None:
    model = nn.Linear(2, 1)
    x = torch.randn(3, 2)

    class Out:
        def __init__(self, loss: torch.Tensor) -> None:
            self.loss = loss

    wrap = {
        "tuple": lambda loss: (loss, None),
        "dict": lambda loss: {"loss": loss},
        "attr": Out,
    }[form]
    assert count_flops(lambda x: wrap(model(x).sum()), x, model=model).total == 2 * 2 * 3 * 2
