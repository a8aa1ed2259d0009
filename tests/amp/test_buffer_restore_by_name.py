"""A skipped window puts the model's buffers back by name: buffers the forward updates in
place, buffers it re-assigns (``self.mean = ...``), with the same or another shape, on
the host's path and on the device's (``found_inf``, lazily read verdicts)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import cudakit.amp._stepper as amp_stepper
from cudakit.amp import autocast_step

torch.set_num_threads(1)

MODES = ("in place", "re-assigned", "re-assigned, new shape", "untouched")


class Running(nn.Module):
    """A layer whose buffers the forward changes in the ways ``modes`` says."""

    def __init__(self, modes: tuple[str, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.modes = modes
        for i in range(len(modes)):
            self.register_buffer(f"b{i}", torch.full((4,), float(i)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        stat = y.detach().float().mean(0)
        for i, mode in enumerate(self.modes):
            name = f"b{i}"
            if mode == "in place":
                getattr(self, name).mul_(0.9).add_(0.1 * stat)
            elif mode == "re-assigned":
                setattr(self, name, 0.9 * getattr(self, name) + 0.1 * stat)
            elif mode == "re-assigned, new shape":
                setattr(self, name, torch.cat([getattr(self, name), stat])[-4 - 4 * i :])
            y = y - getattr(self, name)[:4]  # the buffers feed the output
        return y


def _step(m: nn.Module, fused: bool) -> object:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
    step = autocast_step(opt, model=m, dtype=torch.float32)
    return step(lambda x: m(x).pow(2).mean())


def _snapshot(m: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (b, b.detach().clone()) for k, b in m.named_buffers()}


def _assert_as_before(m: nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    now = dict(m.named_buffers())
    assert now.keys() == before.keys()
    for name, (tensor, value) in before.items():
        assert now[name] is tensor, f"{name}: another tensor object than before the window"
        assert torch.equal(now[name], value), f"{name}: not restored"


@pytest.mark.parametrize("fused", [False, True])
def test_a_reassigned_buffer_is_restored_and_training_goes_on(fused: bool, skip_on: str) -> None:
    m = Running(("re-assigned",))
    fn = _step(m, fused)
    x = torch.randn(8, 4)
    fn(x)
    before = _snapshot(m)
    assert fn(x * float("nan")).skipped == True  # noqa: E712 (a Verdict compares as a bool)
    _assert_as_before(m, before)
    # The NaN did not stay in the model: the next window steps.
    assert fn(x).stepped == True  # noqa: E712
    assert torch.isfinite(m.b0).all()


def test_a_reassigned_buffer_equals_the_hand_written_loop_after_a_skip() -> None:
    m, ref = Running(("re-assigned",)), Running(("re-assigned",))
    fn = _step(m, fused=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for i, x in enumerate(xs):
        if i == 1:
            assert fn(x * float("nan")).skipped
        fn(x)
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        opt.step()
    assert torch.equal(m.b0, ref.b0)
    assert torch.equal(m.lin.weight, ref.lin.weight)


@given(st.lists(st.sampled_from(MODES), min_size=1, max_size=4), st.booleans())
def test_every_buffer_is_back_by_name_after_a_skipped_window(
    modes: list[str], on_device: bool
) -> None:
    m = Running(tuple(modes))
    with pytest.MonkeyPatch.context() as mp:
        if on_device:  # the GPU's path: restored with torch.where, the verdict read later
            mp.setattr(amp_stepper, "host_read_waits", lambda device_type: True)
        fn = _step(m, fused=True)
    x = torch.randn(8, 4)
    fn(x)
    before = _snapshot(m)
    fn(x * float("nan"))
    _assert_as_before(m, before)
    assert fn.autocast_step.skipped_steps == 1  # type: ignore[attr-defined]
