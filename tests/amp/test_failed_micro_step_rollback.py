"""A micro-step whose backward fails or is interrupted (Ctrl-C) leaves the window as it
was before it: the gradients it had accumulated so far are not kept, and the run goes
on bit for bit as if that micro-step had never been tried."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from cudakit.amp import autocast_step

torch.set_num_threads(1)


class Interrupt(BaseException):
    """Stands for KeyboardInterrupt (which pytest would take as the user's Ctrl-C)."""


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _xs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


def _loss(m: nn.Module, x: torch.Tensor, fail: type[BaseException] | None = None) -> torch.Tensor:
    h = m[1](m[0](x))
    if fail is not None:

        def boom(grad: torch.Tensor) -> None:
            raise fail("interrupted inside backward")

        # Raised once the last layer's gradients have landed: a half-done backward.
        h.register_hook(boom)
    return m[2](h).pow(2).mean()


def _grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _hand_written(xs: list[torch.Tensor], accumulate: int) -> nn.Module:
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for i, x in enumerate(xs):
        (_loss(m, x) / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return m


@pytest.mark.parametrize("fail", [Interrupt, KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("form", ["decorated", "explicit"])
def test_a_failed_micro_step_mid_window_keeps_the_window(
    fail: type[BaseException], form: str
) -> None:
    m = _net()
    step = autocast_step(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), accumulate=3, dtype=torch.float32
    )
    fn = step(lambda x, f=None: _loss(m, x, f))

    def call(x: torch.Tensor, f: type[BaseException] | None = None) -> Any:
        if form == "decorated":
            return fn(x, f)
        with step:
            loss = _loss(m, x, f)
        return step.backward(loss)

    xs = _xs(3)
    call(xs[0])
    before = _grads(m)
    with pytest.raises(fail, match="interrupted inside backward"):
        call(xs[1], fail)
    assert step.position == 1
    assert _same(_grads(m), before)  # not a trace of the failed micro-step
    call(xs[1])
    assert call(xs[2]).stepped
    ref = _hand_written(xs, 3)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_failed_first_micro_step_leaves_no_gradient() -> None:
    m = _net()
    step = autocast_step(torch.optim.SGD(m.parameters(), lr=0.1), accumulate=2, dtype=torch.float32)
    fn = step(lambda x, f=None: _loss(m, x, f))
    with pytest.raises(Interrupt):
        fn(_xs(1)[0], Interrupt)
    assert step.position == 0
    assert all(p.grad is None for p in m.parameters())


@given(
    accumulate=st.integers(1, 4),
    plan=st.lists(st.sampled_from(["ok", "fail"]), min_size=1, max_size=10),
)
def test_failed_micro_steps_change_nothing_against_the_hand_written_loop(
    accumulate: int, plan: list[str]
) -> None:
    xs = _xs(len(plan))
    m = _net()
    step = autocast_step(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        accumulate=accumulate,
        dtype=torch.float32,
    )
    fn = step(lambda x, f=None: _loss(m, x, f))
    done = []
    for x, what in zip(xs, plan, strict=True):
        if what == "fail":
            position = step.position
            with pytest.raises(Interrupt):
                fn(x, Interrupt)
            assert step.position == position
        else:
            fn(x)
            done.append(x)
    ref = _hand_written(done, accumulate)
    if len(done) % accumulate:  # the open window: its gradients so far, exactly
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


class LooksLikeDDP(nn.Module):
    """A model with DDP's ``no_sync()``: its window's last micro-step is the synced one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def test_a_failure_in_the_synchronised_micro_step_drops_the_window() -> None:
    m = LooksLikeDDP()
    step = autocast_step(
        torch.optim.SGD(m.parameters(), lr=0.1), model=m, accumulate=2, dtype=torch.float32
    )
    fn = step(lambda x, f=None: _loss(m.net, x, f))
    xs = _xs(2)
    fn(xs[0])
    with pytest.raises(Interrupt) as info:
        fn(xs[1], Interrupt)  # DDP's reducer reads .grad here: it cannot be set aside
    assert step.position == 0
    assert all(p.grad is None for p in m.parameters())
    notes = "".join(info.value.__notes__)
    assert "DDP's synchronised backward of micro-step 2" in notes
    assert "the window was dropped" in notes
    fn(xs[0])
    assert fn(xs[1]).stepped
