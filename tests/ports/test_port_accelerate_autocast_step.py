"""autocast_step against accelerate's optimizer, scheduler and accumulation tests.

Ported from Hugging Face accelerate tests/test_optimizer.py
(test_accelerated_optimizer_step_was_skipped), tests/test_scheduler.py (one_cycle_test,
accumulation_test), src/accelerate/test_utils/scripts/test_sync.py
(test_gradient_accumulation_with_opt_and_scheduler, in one process),
tests/test_accelerator.py (clip_grad_norm_ with gradient accumulation) and
tests/test_state_checkpointing.py (resume from a checkpoint bit for bit).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from port_accelerate_helpers import RegressionModel, regression_data

from cudakit.amp import autocast_step


def _params_close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _fp16_scaler(dtype: str) -> dict[str, Any]:
    """A CPU GradScaler with a small initial scale, for dtype="fp16"."""
    return {"scaler": torch.amp.GradScaler("cpu", init_scale=2.0**4)} if dtype == "fp16" else {}


@pytest.mark.parametrize("dtype", ["fp16", "fp32", "bf16"])
def test_step_was_skipped_sequence(dtype: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 5)
    step = autocast_step(
        torch.optim.SGD(model.parameters(), 0.1), dtype=dtype, **_fp16_scaler(dtype)
    )
    bad = [False]
    model.weight.register_hook(lambda g: g * float("nan") if bad[0] else g)
    fn = step(lambda x: model(x).float().pow(2).mean())
    for is_bad in [False, True, True, False]:
        bad[0] = is_bad
        before = [p.detach().clone() for p in model.parameters()]
        r = fn(torch.randn(2, 5))
        assert bool(r.skipped) == is_bad
        assert bool(r.stepped) == (not is_bad)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert unchanged == is_bad
    assert step.steps == 2
    assert step.skipped_steps == 2


def test_one_cycle_scheduler_steps_with_optimizer() -> None:
    model = torch.nn.Linear(2, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, steps_per_epoch=2, epochs=1)
    step = autocast_step(opt, scheduler=sched)
    step(lambda x: model(x).sum())(torch.randn(2, 2))
    assert sched.last_epoch == 1


@pytest.mark.parametrize("num_steps", [1, 2, 4])
def test_scheduler_counts_optimizer_steps_with_accumulation(num_steps: int) -> None:
    model = torch.nn.Linear(2, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=10.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 10))
    step = autocast_step(opt, scheduler=sched, accumulate=num_steps)
    fn = step(lambda x: model(x).sum())
    for i in range(10 * num_steps):
        fn(torch.randn(2, 2))
        if i == 10 * num_steps - 2:
            assert sched.get_last_lr()[0] != 0
    assert sched.get_last_lr()[0] == 0
    assert step.steps == 10


@pytest.mark.parametrize("form", ["decorated", "explicit"])
def test_gradient_accumulation_with_opt_and_scheduler(form: str) -> None:
    torch.manual_seed(42)
    ref = RegressionModel(0.5, -0.3)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda e: (e + 1) ** 0.65)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: (e + 1) ** 0.65)
    accumulate = 2
    step = autocast_step(opt, scheduler=sched, accumulate=accumulate, dtype="fp32", model=model)
    fn = step(lambda x, y: F.mse_loss(model(x), y))

    def ref_step() -> None:
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()

    pending = 0
    for x, y in regression_data(80):  # 5 batches: 2 full windows and a partial one
        (F.mse_loss(ref(x), y) / accumulate).backward()  # the hand-written reference
        pending += 1
        did_step = pending == accumulate
        if did_step:
            ref_step()
            pending = 0
        if form == "decorated":
            r = fn(x, y)
        else:
            with step:
                loss = F.mse_loss(model(x), y)
            r = step.backward(loss)
        assert bool(r.stepped) == did_step
        if not did_step:  # gradients accumulate, equal to the reference's
            for p, q in zip(ref.parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad)
        _params_close(ref, model)
        assert ref_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # End of the data: flush the partial window (cudakit: the mean of its micro-steps).
    for p in ref.parameters():
        assert p.grad is not None
        p.grad.mul_(accumulate / pending)
    ref_step()
    r = fn.flush() if form == "decorated" else step.flush()
    assert r is not None
    assert r.stepped
    _params_close(ref, model)
    assert ref_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert step.position == 0
    assert step.steps == 3


def test_flush_on_empty_window_is_noop() -> None:
    model = torch.nn.Linear(2, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    fn = step(lambda x: model(x).sum())
    fn(torch.randn(2, 2))
    fn(torch.randn(2, 2))
    before = [p.detach().clone() for p in model.parameters()]
    assert fn.flush() is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert step.steps == 1


def test_flush_of_skipped_partial_window_leaves_scheduler() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    step = autocast_step(opt, accumulate=3, scheduler=sched, dtype="fp32")
    k = [1.0]
    fn = step(lambda x: model(x).sum() * k[0])
    for _ in range(3):
        fn(torch.randn(2, 2))
    assert sched.last_epoch == 1
    k[0] = float("nan")
    fn(torch.randn(2, 2))
    r = fn.flush()
    assert r is not None
    assert r.skipped
    assert (sched.last_epoch, step.steps, step.position) == (1, 1, 0)


def test_accumulate_change_mid_window_refused() -> None:
    model = torch.nn.Linear(2, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    step(lambda x: model(x).sum())(torch.randn(2, 2))
    with pytest.raises(ValueError, match="can change only between windows"):
        step.accumulate = 4


def test_clip_grad_norm_matches_manual_with_accumulation() -> None:
    """Clipped once per optimizer step, on the accumulated gradients."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    step = autocast_step(
        torch.optim.SGD(model.parameters(), lr=0.5), accumulate=2, max_grad_norm=0.1, dtype="fp32"
    )
    fn = step(lambda x, y: F.mse_loss(model(x), y))
    for i in range(6):
        x, y = torch.randn(8, 4) * 10, torch.randn(8, 3)
        (F.mse_loss(ref(x), y) / 2).backward()
        r = fn(x, y)
        if i % 2 == 1:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(r.grad_norm, norm)
        else:
            assert r.grad_norm is None
        _params_close(ref, model)


def test_fp16_scale_backs_off_and_grows() -> None:
    model = torch.nn.Linear(3, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.01), dtype="fp16", scaler=scaler)
    k = [1.0]
    fn = step(lambda x: model(x).float().mean() * k[0])
    scales = []
    for factor in [1.0, float("inf"), 1.0, 1.0, 1.0]:
        k[0] = factor
        r = fn(torch.randn(2, 3))
        assert bool(r.skipped) == (factor == float("inf"))
        scales.append(float(r.scale))
    # The scale each step used: halved after the overflow, doubled after growth_interval=2
    # clean steps.
    assert scales == [16, 16, 8, 8, 16]


def _build_run(dtype: str) -> tuple[RegressionModel, dict[str, Any], Callable[..., Any]]:
    torch.manual_seed(0)
    model = RegressionModel(0.5, -0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / (1 + e))
    kw = {"scaler": torch.amp.GradScaler("cpu", init_scale=2.0**6)} if dtype == "fp16" else {}
    step = autocast_step(opt, scheduler=sched, accumulate=2, dtype=dtype, **kw)
    fn = step(lambda x, y: F.mse_loss(model(x).float(), y))
    return model, {"model": model, "opt": opt, "sched": sched, "step": step}, fn


@pytest.mark.parametrize("stop_at", [2, 3])  # at a window's end, in its middle
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_checkpoint_resume_bit_for_bit(stop_at: int, dtype: str) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, generator=g), torch.randn(8, generator=g)) for _ in range(7)]
    model, _, fn = _build_run(dtype)
    for x, y in data:
        fn(x, y)
    full = [p.detach().clone() for p in model.parameters()]

    _, parts, fn = _build_run(dtype)
    for x, y in data[:stop_at]:
        fn(x, y)
    checkpoint = copy.deepcopy({k: v.state_dict() for k, v in parts.items()})
    resumed, parts2, fn2 = _build_run(dtype)
    for k, v in parts2.items():
        v.load_state_dict(checkpoint[k])
    assert parts2["step"].position == parts["step"].position
    assert parts2["step"].steps == parts["step"].steps
    for x, y in data[stop_at:]:
        fn2(x, y)
    for a, b in zip(full, resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_result_loss_is_not_divided_by_accumulate() -> None:
    model = torch.nn.Linear(2, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4, dtype="fp32")
    x = torch.randn(3, 2)
    expected = model(x).pow(2).mean().detach()
    r = step(lambda x: model(x).pow(2).mean())(x)
    torch.testing.assert_close(r.loss, expected)
    assert not r.loss.requires_grad


def test_step_under_no_grad_refused_autocast_allowed() -> None:
    """Evaluation inside the training loop: autocast() works under no_grad, a step does not."""
    model = torch.nn.Linear(2, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1))
    fn = step(lambda x: model(x).sum())
    with torch.no_grad():
        with pytest.raises(ValueError, match="gradients are disabled here"):
            fn(torch.randn(2, 2))
        with step.autocast():
            model(torch.randn(2, 2))
    assert step.steps == 0
