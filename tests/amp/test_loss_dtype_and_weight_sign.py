"""The loss's kind and the token weight's sign: an integer or complex loss is a
TypeError naming its dtype; a negative weight tensor makes the window skip, decided on
the device like an inf/NaN (no host read), instead of stepping uphill."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from cudakit.amp import autocast_step

torch.set_num_threads(1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        (lambda m: torch.tensor(3), "torch.int64"),
        (lambda m: torch.tensor(True), "torch.bool"),
        (lambda m: m(torch.ones(2, 4)).sum().to(torch.complex64), "torch.complex64"),
    ],
)
@pytest.mark.parametrize("form", ["decorated", "backward"])
def test_a_loss_that_is_not_real_floating_point_is_a_type_error(
    make: Any, dtype: str, form: str
) -> None:
    m = _net()
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), dtype=torch.float32)
    call = step(lambda: make(m)) if form == "decorated" else lambda: step.backward(make(m))
    with pytest.raises(
        TypeError, match=rf"autocast_step: the loss must be a real floating-point .*{dtype}"
    ):
        call()
    assert m.weight.grad is None
    assert step.position == 0


def test_the_dtype_check_keeps_a_float_loss_in_a_mapping() -> None:
    m = _net()
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), dtype=torch.float32)
    assert step.backward({"loss": m(torch.ones(2, 4)).sum().double()}).stepped


def _weighted(fused: bool, **options: Any) -> tuple[nn.Module, Any]:
    m = _net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=fused)
    step = autocast_step(opt, dtype=torch.float32, accumulate=2, **options)

    @step
    def fn(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": m(x).pow(2).sum(), "weight": w}

    return m, fn


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("weights", [(-1, 3), (3, -1), (-2, -2)])
def test_a_negative_weight_tensor_skips_the_window(
    fused: bool, weights: tuple[int, int], skip_on: str
) -> None:
    m, fn = _weighted(fused)
    before = m.weight.detach().clone()
    x = torch.ones(3, 4)
    fn(x, torch.tensor(weights[0]))
    r = fn(x, torch.tensor(weights[1]))
    assert r.skipped == True  # noqa: E712 (a Verdict compares as a bool)
    assert torch.equal(m.weight, before)
    assert fn.autocast_step.skipped_steps == 1
    fn(x, torch.tensor(3))
    assert fn(x, torch.tensor(2)).stepped == True  # noqa: E712


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host: item, bool, tolist."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("item", "__bool__", "tolist"):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_a_negative_weight_reads_nothing_on_the_host(skip_on: str) -> None:
    _m, fn = _weighted(fused=True)
    x = torch.ones(3, 4)
    with HostReads() as reads:
        fn(x, torch.tensor(2))
        fn(x, torch.tensor(-2))
        fn(x, torch.tensor(2))
        fn(x, torch.tensor(2))
    assert reads.calls == []
    assert fn.autocast_step.skipped_steps == 1


def test_zero_and_positive_weights_still_step() -> None:
    _m, fn = _weighted(fused=False)
    x = torch.ones(3, 4)
    fn(x, torch.tensor(0))
    assert fn(x, torch.tensor(4.0)).stepped


def test_a_streak_of_negative_weights_says_a_weight_may_be_the_cause() -> None:
    """Skips for a negative weight count towards max_skipped like an inf/NaN, and the
    streak error names that cause too, not only an inf/NaN loss or gradient."""
    from cudakit.exceptions import NonFiniteStepsError

    m, fn = _weighted(fused=False, max_skipped=2)
    before = m.weight.detach().clone()
    x = torch.ones(3, 4)
    fn(x, torch.tensor(1))
    fn(x, torch.tensor(-1))
    fn(x, torch.tensor(1))
    with pytest.raises(NonFiniteStepsError, match=r"or a token weight was negative"):
        fn(x, torch.tensor(-1))
    assert torch.equal(m.weight, before)


def test_an_unweighted_streak_does_not_mention_weights() -> None:
    from cudakit.exceptions import NonFiniteStepsError

    m = _net()
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), max_skipped=1)
    loss = m(torch.full((2, 4), float("nan"))).sum()
    with pytest.raises(NonFiniteStepsError) as info:
        step.backward(loss)
    assert "token weight" not in str(info.value)
