"""Tests for cudakit.amp: autocast_step() against the hand-written AMP loop."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from launcher_env import free_port

from cudakit.amp import AutocastStep, StepResult, autocast_step
from cudakit.exceptions import CudakitError, NonFiniteStepsError

SEED = 1234


class Net(torch.nn.Module):
    """A small MLP with a buffer that the forward reads and updates (like BatchNorm)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, width)
        self.fc2 = torch.nn.Linear(width, 1)
        self.register_buffer("running", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(h.float().mean(0), alpha=0.1)
        return self.fc2(h)


def make(
    seed: int = SEED, device: str = "cpu", opt: str = "adam"
) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net().to(device)
    if opt == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer


def batches(n: int, device: str = "cpu", size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        (torch.randn(size, 8, generator=g).to(device), torch.randn(size, 1, generator=g).to(device))
        for _ in range(n)
    ]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
    }


def assert_identical(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, path
        assert torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def hand_written(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device_type: str = "cpu",
) -> None:
    """The seed's plain AMP loop, verbatim."""
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    for x, y in data:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_of(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_identical_to_hand_written_loop(dtype: torch.dtype) -> None:
    data = batches(6)
    ref_model, ref_opt = make()
    hand_written(ref_model, ref_opt, data, dtype)

    model, opt = make()
    step = autocast_step(opt, dtype=dtype)

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_of(model, x, y)

    for x, y in data:
        r = train_step(x, y)
        assert r.stepped != r.skipped
    assert_identical(snapshot(model, opt), snapshot(ref_model, ref_opt))
    # fp16's scaler starts at 2**16, which overflows this net's first gradients: the
    # hand-written loop skips those steps too (identical weights prove it).
    assert step.steps + step.skipped_steps == 6
    assert step.skipped_steps == (0 if dtype != torch.float16 else step.skipped_steps)
    assert step.steps >= 3
    assert (step.scaler is not None) == (dtype == torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_explicit_form_bit_identical(dtype: torch.dtype) -> None:
    data = batches(4)
    ref_model, ref_opt = make()
    hand_written(ref_model, ref_opt, data, dtype)
    model, opt = make()
    step = autocast_step(opt, dtype=dtype)
    for x, y in data:
        with step:
            loss = loss_of(model, x, y)
        r = step.backward(loss)
        assert r.stepped != r.skipped
    assert_identical(snapshot(model, opt), snapshot(ref_model, ref_opt))


@pytest.mark.parametrize("native", [True, False])
def test_auto_takes_bf16_where_the_cpu_has_it_natively(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """The probe is faked: the same test holds on a CPU with AVX512-bf16/AMX and without."""
    from cudakit.amp import policy

    monkeypatch.setattr(policy, "cpu_native_bf16", lambda: native)
    monkeypatch.setattr(policy, "cpu_native_fp16", lambda: False)
    _, opt = make()
    step = autocast_step(opt)
    expected = (torch.bfloat16, True) if native else (torch.float32, False)
    assert (step.dtype, step.enabled) == expected


def test_resolved_attributes_and_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    from cudakit.amp import policy

    monkeypatch.setattr(policy, "cpu_native_bf16", lambda: True)  # (as on an AMX CPU)
    _, opt = make()
    step = autocast_step(opt)
    assert (step.dtype, step.device_type, step.enabled) == (torch.bfloat16, "cpu", True)
    ac = step.autocast()
    assert isinstance(ac, torch.autocast)
    with ac:
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert step.autocast() is not ac
    off = autocast_step(opt, enabled=False)
    assert (off.dtype, off.enabled, off.scaler) == (torch.float32, False, None)
    fp32 = autocast_step(opt, dtype=torch.float32)
    assert (fp32.dtype, fp32.enabled) == (torch.float32, False)
    fp16 = autocast_step(opt, dtype="fp16")
    assert fp16.dtype == torch.float16
    assert isinstance(fp16.scaler, torch.amp.GradScaler)
    assert autocast_step(opt, dtype="bf16").dtype == torch.bfloat16
    assert "dtype=torch.bfloat16" in repr(step)


def test_user_scaler_is_used_and_selects_fp16() -> None:
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    step = autocast_step(opt, scaler=scaler)
    assert step.scaler is scaler
    assert step.dtype == torch.float16
    x, y = batches(1)[0]
    r = step(lambda: loss_of(model, x, y))()
    assert r.stepped
    assert r.scale is not None
    assert float(r.scale) == 1024.0
    assert scaler.get_scale() == 1024.0


# ----------------------------------------------------------------------------- return forms


@pytest.mark.parametrize("form", ["tensor", "tuple", "list", "dict"])
def test_return_forms(form: str) -> None:
    model, opt = make()
    x, y = batches(1)[0]

    @autocast_step(opt)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> Any:
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        return {
            "tensor": loss,
            "tuple": (loss, out),
            "list": [loss, out],
            "dict": {"loss": loss, "out": out},
        }[form]

    r = train_step(x, y)
    assert isinstance(r, StepResult)
    assert r.stepped
    assert not r.skipped
    assert r.scale is None
    assert r.grad_norm is None
    assert not r.loss.requires_grad
    assert r.loss.dim() == 0
    assert type(r.output).__name__ == {"tensor": "Tensor", "tuple": "tuple", "list": "list",
                                       "dict": "dict"}[form]  # fmt: skip
    assert train_step.__name__ == "train_step"
    assert isinstance(train_step.autocast_step, AutocastStep)


@pytest.mark.parametrize(
    ("ret", "exc", "match"),
    [
        (lambda loss: None, TypeError, "must return the loss.*got NoneType.*return loss"),
        (lambda loss: 1.5, TypeError, "must return the loss.*got float"),
        (lambda loss: {"out": loss}, TypeError, "without a 'loss' key.*keys: \\['out'\\]"),
        (lambda loss: (), TypeError, "empty tuple"),
        (lambda loss: (loss.item(), loss), TypeError, "must be a torch.Tensor.*not loss.item"),
        (lambda loss: loss.expand(3), ValueError, "scalar tensor, got shape \\(3,\\).*mean"),
        (lambda loss: loss.detach(), ValueError, "does not require grad.*no_grad"),
    ],
)
def test_bad_returns_are_clear_errors_and_change_nothing(ret: Any, exc: type, match: str) -> None:
    model, opt = make()
    before = snapshot(model, opt)
    x, y = batches(1)[0]

    @autocast_step(opt)
    def train_step() -> Any:
        return ret(loss_of(model, x, y))

    with pytest.raises(exc, match=match):
        train_step()
    after = snapshot(model, opt)
    # The forward ran (the buffer moved); weights and optimizer state did not.
    assert_identical({k: v for k, v in after["model"].items() if k != "running"},
                     {k: v for k, v in before["model"].items() if k != "running"})  # fmt: skip
    assert_identical(after["opt"], before["opt"])
    assert train_step.autocast_step.position == 0


# ----------------------------------------------------------------------------- accumulation


def test_accumulation_equals_one_step_on_concatenated_batch() -> None:
    data = batches(4, size=4)
    ref, ref_opt = make(opt="sgd")
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    loss_of(ref, x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
    ref_opt.step()

    model, opt = make(opt="sgd")

    @autocast_step(opt, dtype=torch.float32, accumulate=4, max_grad_norm=0.5)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_of(model, x, y)

    results = [train_step(*b) for b in data]
    assert [r.stepped for r in results] == [False, False, False, True]
    assert [r.grad_norm is None for r in results] == [True, True, True, False]
    assert torch.allclose(results[-1].grad_norm, ref_norm, rtol=1e-5)  # type: ignore[arg-type]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # Gradients stay readable after the step (for logging) until the next window opens.
    assert all(p.grad is not None for p in model.parameters())


def test_clipping_once_per_step_after_unscale(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = make(opt="sgd")
    step = autocast_step(opt, dtype=torch.float16, accumulate=3, max_grad_norm=1e-3)
    scaler = step.scaler
    assert scaler is not None
    stages: list[str] = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params: Any, max_norm: float, *a: Any, **k: Any) -> torch.Tensor:
        stages.append(scaler._per_optimizer_states[id(opt)]["stage"].name)
        return real_clip(params, max_norm, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    # fp32 reference of the same window's gradient norm.
    ref, _ = make(opt="sgd")
    data = batches(3)
    for x, y in data:
        (loss_of(ref, x, y) / 3).backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))

    results = []
    for x, y in data:
        with step:
            loss = loss_of(model, x, y)
        results.append(step.backward(loss))
    assert stages == ["UNSCALED"]
    norm = results[-1].grad_norm
    assert norm is not None
    assert results[-1].stepped
    # An unscaled norm (the scale is 65536): close to the fp32 reference.
    torch.testing.assert_close(norm.float(), ref_norm, rtol=2e-2, atol=1e-4)
    assert results[0].scale is not None
    assert float(results[0].scale) == 65536.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_bit_identical_to_hand_written_loop(dtype: torch.dtype) -> None:
    data = batches(5)
    ref_model, ref_opt = make()
    ref_norms = []
    for x, y in data:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_of(ref_model, x, y)
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05))
        ref_opt.step()
        ref_opt.zero_grad()

    model, opt = make()
    fn = autocast_step(opt, dtype=dtype, max_grad_norm=0.05)(lambda x, y: loss_of(model, x, y))
    norms = [fn(x, y).grad_norm for x, y in data]
    assert_identical(snapshot(model, opt), snapshot(ref_model, ref_opt))
    assert_identical(norms, ref_norms)


@pytest.mark.parametrize("with_model", [True, False])
def test_clipping_with_decay_groups_matches_clipping_model_parameters(with_model: bool) -> None:
    # Hugging Face's loops clip model.parameters() while AdamW holds the Trainer's
    # decay / no-decay groups, another order: the total norm is summed in the model's
    # order with model=, bit for bit; without it, in the optimizers' order.
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(6)))
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases}]
        return model, torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0)

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(12)]
    ref_model, ref_opt = build()
    ref_norms = []
    for x, y in data:
        F.mse_loss(ref_model(x), y).backward()
        clipped = ref_model.parameters() if with_model else ref_opt.param_groups[0]["params"] + \
            ref_opt.param_groups[1]["params"]  # fmt: skip
        ref_norms.append(torch.nn.utils.clip_grad_norm_(clipped, 0.01))
        ref_opt.step()
        ref_opt.zero_grad()

    model, opt = build()
    step = autocast_step(
        opt, model=model if with_model else None, dtype=torch.float32, max_grad_norm=0.01
    )
    fn = step(lambda x, y: F.mse_loss(model(x), y))
    norms = [fn(x, y).grad_norm for x, y in data]
    assert_identical(norms, ref_norms)
    assert_identical(snapshot(model, opt), snapshot(ref_model, ref_opt))


def test_clipping_norm_that_overflows_on_finite_grads_still_steps() -> None:
    # Finite gradients of 1e30: their 2-norm overflows float32 to inf. The hand-written
    # loop clips them to zero and steps; the guard (which reads that norm) must confirm
    # with its exact check that no gradient is inf/NaN, and step too.
    def huge(model: Net) -> torch.utils.hooks.RemovableHandle:
        return model.fc1.weight.register_hook(lambda g: torch.full_like(g, 1e30))

    x, y = batches(1)[0]
    ref_model, ref_opt = make()
    h = huge(ref_model)
    loss_of(ref_model, x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
    ref_opt.step()
    h.remove()
    assert torch.isinf(ref_norm)

    model, opt = make()
    h = huge(model)
    step = autocast_step(opt, dtype=torch.float32, max_grad_norm=1.0)
    with step:
        loss = loss_of(model, x, y)
    r = step.backward(loss)
    h.remove()
    assert r.stepped
    assert not r.skipped
    assert r.grad_norm is not None
    assert torch.isinf(r.grad_norm)
    assert_identical(snapshot(model, opt), snapshot(ref_model, ref_opt))


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_host_sync_per_optimizer_step(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, clip: float | None
) -> None:
    model, opt = make(opt="sgd")  # SGD's own step reads no scalar back
    step = autocast_step(opt, dtype=dtype, accumulate=2, max_grad_norm=clip)
    reads = []
    real_item = torch.Tensor.item

    def spy(t: torch.Tensor) -> Any:
        reads.append(t.numel())
        return real_item(t)

    monkeypatch.setattr(torch.Tensor, "item", spy)
    fn = step(lambda x, y: loss_of(model, x, y))
    per_call = []
    for x, y in batches(6):
        r = fn(x, y)
        per_call.append((r.stepped, len(reads)))
        reads.clear()
    # Micro-steps read nothing back; each real optimizer step reads the verdict once.
    assert per_call == [(False, 0), (True, 1)] * 3
    off = autocast_step(opt, dtype=dtype, skip_nonfinite=False, max_grad_norm=clip)
    assert off(lambda x, y: loss_of(model, x, y))(*batches(1)[0]).stepped
    assert reads == []


def test_flush_steps_partial_window_as_mean() -> None:
    data = batches(2, size=4)
    ref, ref_opt = make(opt="sgd")
    loss_of(ref, torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])).backward()
    ref_opt.step()

    model, opt = make(opt="sgd")

    @autocast_step(opt, dtype=torch.float32, accumulate=4)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_of(model, x, y)

    assert train_step.flush() is None
    for b in data:
        assert not train_step(*b).stepped
    r = train_step.flush()
    assert r is not None
    assert r.stepped
    assert r.output is None
    assert train_step.autocast_step.position == 0
    assert train_step.autocast_step.steps == 1
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert train_step.flush() is None


# ----------------------------------------------------------------------------- non-finite guard


def inject(kind: str, model: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "nan_loss":
        return loss_of(model, x, y) * torch.tensor(float("nan"))
    loss = loss_of(model, x, y)
    bad = float("inf") if kind == "inf_grad" else float("nan")
    # An inf/NaN that only appears in the gradient, not in the loss.
    h = model.fc1.weight.register_hook(lambda g: torch.full_like(g, bad))
    inject.handles.append(h)  # type: ignore[attr-defined]
    return loss


inject.handles = []  # type: ignore[attr-defined]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("kind", ["inf_grad", "nan_grad", "nan_loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_step_is_skipped_and_changes_nothing(
    kind: str, dtype: torch.dtype, clip: float | None
) -> None:
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = autocast_step(opt, model=model, dtype=dtype, scheduler=sched, max_grad_norm=clip)
    good = batches(3)

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        return inject(kind, model, x, y) if kind else loss_of(model, x, y)

    assert train_step(*good[0]).stepped
    before = snapshot(model, opt)
    lr = opt.param_groups[0]["lr"]
    scale_before = None if step.scaler is None else step.scaler.get_scale()
    r = train_step(*good[1], kind=kind)
    for h in inject.handles:  # type: ignore[attr-defined]
        h.remove()
    inject.handles.clear()  # type: ignore[attr-defined]
    assert r.skipped
    assert not r.stepped
    assert r.grad_norm is None
    assert_identical(snapshot(model, opt), before)  # weights, buffers, optimizer state
    assert opt.param_groups[0]["lr"] == lr
    assert sched.last_epoch == 1
    # The skipped window's gradients stay readable until the next window clears them.
    assert all(p.grad is not None for p in model.parameters())
    if step.scaler is not None and kind != "nan_loss":
        assert step.scaler.get_scale() == scale_before * 0.5  # type: ignore[operator]
    assert step.skipped_steps == 1
    assert step.steps == 1
    # Training continues on the next good batch.
    r = train_step(*good[2])
    assert r.stepped
    assert not r.skipped
    assert sched.last_epoch == 2


def test_skip_nonfinite_false_steps_anyway_in_bf16() -> None:
    model, opt = make(opt="sgd")
    step = autocast_step(opt, skip_nonfinite=False)
    x, y = batches(1)[0]
    with step:
        loss = loss_of(model, x, y) * float("nan")
    r = step.backward(loss)
    assert r.stepped
    assert not r.skipped
    assert torch.isnan(model.fc2.weight).all()


def test_too_many_skipped_steps_raise() -> None:
    model, opt = make()
    step = autocast_step(opt, max_skipped=3)
    x, y = batches(1)[0]
    before = snapshot(model, opt)

    def bad() -> StepResult:
        with step:
            loss = loss_of(model, x, y) * float("inf")
        return step.backward(loss)

    assert bad().skipped
    assert bad().skipped
    with pytest.raises(
        NonFiniteStepsError, match="skipped 3 optimizer steps in a row.*max_skipped"
    ):
        bad()
    assert_identical(snapshot(model, opt)["opt"], before["opt"])
    assert isinstance(NonFiniteStepsError("x"), (CudakitError, RuntimeError))
    assert autocast_step(opt, dtype=torch.float16).max_skipped == 20
    assert autocast_step(opt).max_skipped == 10


@given(
    accumulate=st.integers(1, 4),
    bad=st.lists(st.booleans(), min_size=0, max_size=12),
    flush=st.booleans(),
)
def test_property_step_counts(accumulate: int, bad: list[bool], flush: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
    step = autocast_step(opt, accumulate=accumulate, scheduler=sched, max_skipped=10**6)
    x = torch.ones(2, 2)
    for b in bad:
        with step:
            loss = model(x).float().mean() * (float("nan") if b else 1.0)
        step.backward(loss)
    if flush:
        step.flush()
    windows = [bad[i : i + accumulate] for i in range(0, len(bad), accumulate)]
    if not flush and windows and len(windows[-1]) < accumulate:
        windows.pop()
    expected = sum(1 for w in windows if not any(w))
    assert step.steps == expected
    assert step.skipped_steps == len(windows) - expected
    assert sched.last_epoch == expected
    state = opt.state[model.weight]
    assert (int(state["step"]) if state else 0) == expected


# ----------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_state_dict_round_trip_mid_accumulation(dtype: torch.dtype) -> None:
    data = batches(7)

    def run(model: Net, step: AutocastStep, part: list[Any]) -> None:
        for x, y in part:
            with step:
                loss = loss_of(model, x, y)
            step.backward(loss)

    model, opt = make()
    step = autocast_step(opt, dtype=dtype, accumulate=3, max_grad_norm=1.0)
    run(model, step, data)
    expected = snapshot(model, opt)

    model, opt = make()
    step = autocast_step(opt, dtype=dtype, accumulate=3, max_grad_norm=1.0)
    run(model, step, data[:5])  # one step, then 2 micro-steps into the second window
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step.state_dict()},
               buf)  # fmt: skip
    assert step.state_dict()["position"] == 2

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2, opt2 = make(seed=7)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    step2 = autocast_step(opt2, dtype=dtype, accumulate=3, max_grad_norm=1.0)
    step2.load_state_dict(ckpt["step"])
    assert step2.position == 2
    assert step2.steps == 1
    run(model2, step2, data[5:])
    assert_identical(snapshot(model2, opt2), expected)


def test_load_state_dict_errors_change_nothing() -> None:
    _, opt = make()
    step = autocast_step(opt, accumulate=2)
    _x, y = batches(1)[0]
    with step:
        loss = step.optimizer.param_groups[0]["params"][0].sum() * 0 + y.sum()
    step.backward(loss)
    state = step.state_dict()
    other = autocast_step(make()[1], accumulate=3)
    with pytest.raises(ValueError, match="mid-window with accumulate=2.*accumulate=3"):
        other.load_state_dict(state)
    assert other.position == 0
    fp16 = autocast_step(make()[1], dtype=torch.float16, accumulate=2)
    with pytest.raises(ValueError, match="taken without a GradScaler but this step has one"):
        fp16.load_state_dict(state)
    with pytest.raises(ValueError, match="missing \\['scaler'"):
        step.load_state_dict({k: v for k, v in state.items() if k != "scaler"})
    with pytest.raises(TypeError, match="expects the dict from AutocastStep.state_dict"):
        step.load_state_dict([])  # type: ignore[arg-type]
    small = torch.nn.Linear(2, 1)
    s2 = autocast_step(torch.optim.SGD(small.parameters(), lr=0.1), accumulate=2)
    with pytest.raises(ValueError, match="gradients for 4 parameters but the optimizer has 2"):
        s2.load_state_dict(state)
    assert all(p.grad is None for p in small.parameters())


# ----------------------------------------------------------------------------- DDP-like model


class FakeDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.synced_forwards: list[bool] = []
        self.sync = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.synced_forwards.append(self.sync)
        return self.module(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("form", ["decorator", "explicit"])
def test_no_sync_only_on_micro_steps_that_do_not_step(form: str) -> None:
    net, opt = make()
    ddp = FakeDDP(net)
    step = autocast_step(opt, model=ddp, accumulate=3)
    data = batches(6)
    if form == "decorator":
        fn = step(lambda x, y: loss_of(ddp, x, y))
        results = [fn(x, y) for x, y in data]
    else:
        results = []
        for x, y in data:
            with step:
                loss = loss_of(ddp, x, y)
            results.append(step.backward(loss))
    assert ddp.synced_forwards == [False, False, True] * 2
    assert [r.stepped for r in results] == [False, False, True] * 2


# ----------------------------------------------------------------------------- misuse


def test_nested_steps_are_an_error() -> None:
    model, opt = make()
    x, y = batches(1)[0]
    inner = autocast_step(opt)(lambda: loss_of(model, x, y))
    before = snapshot(model, opt)

    @autocast_step(opt)
    def outer() -> torch.Tensor:
        inner()
        return loss_of(model, x, y)

    with pytest.raises(RuntimeError, match="inside another autocast_step.*one after the other"):
        outer()
    step = autocast_step(opt)
    with pytest.raises(RuntimeError, match="inside the same autocast_step"), step, step:
        pass
    with step, pytest.raises(RuntimeError, match="inside another autocast_step"):
        inner()
    with pytest.raises(RuntimeError, match="inside the same autocast_step"):
        step(lambda: step.backward(loss_of(model, x, y)))()
    with step, pytest.raises(RuntimeError, match="flush\\(\\) called inside a step"):
        step.flush()
    assert_identical(snapshot(model, opt)["opt"], before["opt"])
    # After all that, a normal call works (the nesting marker was reset).
    assert inner().stepped


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"dtype": "fp8"}, ValueError, "dtype='fp8'.*\"auto\", torch.bfloat16"),
        ({"dtype": torch.int8}, ValueError, "not a mixed-precision dtype"),
        ({"dtype": 16}, TypeError, "expects a torch.dtype or 'auto', got int"),
        ({"accumulate": 0}, ValueError, r"accumulate=...\) expects an int >= 1, got int 0"),
        ({"accumulate": True}, TypeError, r"accumulate=...\) expects an int >= 1, got bool"),
        ({"accumulate": "4"}, TypeError, r"accumulate=...\) expects an int >= 1, got str"),
        ({"max_grad_norm": -1.0}, ValueError, r"max_grad_norm=...\) expects a positive finite"),
        ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm=...\\).*got float nan"),
        ({"max_grad_norm": "1"}, TypeError, "max_grad_norm=...\\).*got str '1'"),
        ({"max_skipped": 0}, ValueError, "max_skipped=...\\).*got int 0.*sys.maxsize"),
        ({"enabled": 1}, TypeError, "enabled=...\\) expects True or False, got int 1"),
        ({"skip_nonfinite": None}, TypeError, "skip_nonfinite=...\\) expects True or False"),
        ({"model": "net"}, TypeError, "model=...\\) expects the torch.nn.Module.*got str"),
        (
            {"scheduler": 3},
            TypeError,
            "scheduler=...\\) expects.*step\\(\\) method \\(or a list of them\\), got int",
        ),
        ({"scaler": object()}, TypeError, "scaler=...\\) expects a torch.amp.GradScaler"),
        (
            {"dtype": torch.bfloat16, "scaler": "gs"},
            ValueError,
            "only for float16.*Drop scaler",
        ),
    ],
)
def test_bad_options(kwargs: dict[str, Any], exc: type, match: str) -> None:
    _, opt = make()
    if kwargs.get("scaler") == "gs":
        kwargs["scaler"] = torch.amp.GradScaler("cpu")
    with pytest.raises(exc, match=match):
        autocast_step(opt, **kwargs)


def test_bad_optimizer_and_decorator_misuse() -> None:
    model, opt = make()
    with pytest.raises(TypeError, match="without arguments; write @autocast_step\\(optimizer"):
        autocast_step(lambda: None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"optimizer=...\) expects .* got Net (?s:.*) Pass the optimizer first, and the",
    ):
        autocast_step(model)  # type: ignore[arg-type]
    empty = torch.optim.SGD(model.parameters(), lr=0.1)
    empty.param_groups[0]["params"] = []
    with pytest.raises(ValueError, match="optimizer with no parameters.*model.parameters"):
        autocast_step(empty)
    with pytest.raises(ValueError, match="ReduceLROnPlateau.*scheduler.step\\(val_loss\\)"):
        autocast_step(opt, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    step = autocast_step(opt)
    with pytest.raises(TypeError, match="called with a tensor.*step.backward\\(loss\\)"):
        step(torch.ones(()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a function to decorate, got int"):
        step(3)  # type: ignore[arg-type]

    def gen() -> Iterator[torch.Tensor]:
        yield torch.ones(())

    with pytest.raises(TypeError, match="generator or coroutine function"):
        step(gen)


def test_device_that_cannot_run_the_dtype() -> None:
    meta = torch.nn.Linear(2, 2, device="meta")
    opt = torch.optim.SGD(meta.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="on 'meta', where torch.autocast is not available"):
        autocast_step(opt, dtype=torch.float16)


def test_fp16_refused_by_autocast_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.autocast

    def refusing(device_type: str, dtype: Any = None, enabled: bool = True) -> Any:
        if enabled and dtype == torch.float16:
            warnings.warn(
                "In CPU autocast, but the target dtype is not supported. Disabling autocast.",
                UserWarning,
                stacklevel=2,
            )
        return real(device_type, dtype=dtype, enabled=False)

    monkeypatch.setattr(torch, "autocast", refusing)
    _, opt = make()
    with pytest.raises(ValueError, match="dtype=torch.float16\\) cannot run on 'cpu'.*'auto'"):
        autocast_step(opt, dtype=torch.float16)


def test_scaler_for_another_device_is_an_error() -> None:
    _, opt = make()
    with pytest.raises(ValueError, match="GradScaler for 'cuda'.*GradScaler\\('cpu'\\)"):
        autocast_step(opt, scaler=torch.amp.GradScaler("cuda", enabled=False))


# ----------------------------------------------------------------------------- distributed


def _ddp_worker(rank: int, world: int, port: int, dtype: torch.dtype, out: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if dtype == torch.float16 else None
        step = autocast_step(opt, model=ddp, dtype=dtype, accumulate=2, scaler=scaler)

        @step
        def train_step(x: torch.Tensor, poison: bool) -> torch.Tensor:
            loss = ddp(x).float().pow(2).mean()
            return loss * float("nan") if poison else loss

        x = torch.full((2, 4), float(rank + 1))
        flags = []
        for i in range(4):
            # Window 1 (calls 0-1): only rank 1 sees a NaN loss; every rank must skip.
            r = train_step(x, poison=(rank == 1 and i == 1))
            flags.append((r.stepped, r.skipped))
        r = train_step(x, poison=False)
        flags.append((r.stepped, r.skipped))
        step.flush()  # a partial window after no_sync: gradients averaged here
        torch.save({"flags": flags, "w": net.weight.detach().clone(), "steps": step.steps},
                   f"{out}/{rank}.pt")  # fmt: skip
        # Meet before teardown: gloo aborts a rank whose peer destroys the group while
        # it is still finishing ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ddp_ranks_skip_together(tmp_path: Any, dtype: torch.dtype) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _ddp_worker,
        args=(2, free_port(), dtype, str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-process gloo run did not finish within 120 s")
    r0 = torch.load(tmp_path / "0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "1.pt", weights_only=True)
    assert r0["flags"] == r1["flags"]
    assert r0["flags"][:4] == [(False, False), (False, True), (False, False), (True, False)]
    assert r0["steps"] == r1["steps"] == 2
    assert torch.equal(r0["w"], r1["w"])


# ----------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_bit_identical_to_hand_written(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    torch.backends.cudnn.deterministic = True
    data = batches(5, device="cuda")
    ref_model, ref_opt = make(device="cuda")
    hand_written(ref_model, ref_opt, data, dtype, device_type="cuda")
    model, opt = make(device="cuda")
    step = autocast_step(opt, dtype=dtype)
    assert step.device_type == "cuda"
    fn = step(lambda x, y: loss_of(model, x, y))
    for x, y in data:
        r = fn(x, y)
        assert r.stepped != r.skipped
    # fp16's scaler starts at 2**16, which can overflow this net's first gradients: the
    # hand-written loop skips those steps too (identical weights prove it).
    assert_identical(snapshot(model, opt), snapshot(ref_model, ref_opt))
    assert step.steps + step.skipped_steps == len(data)
    assert step.steps >= 1


@pytest.mark.cuda
def test_cuda_auto_dtype_and_skip() -> None:
    model, opt = make(device="cuda")
    step = autocast_step(opt, model=model)
    major, _ = torch.cuda.get_device_capability()
    assert step.dtype == (torch.bfloat16 if major >= 8 else torch.float16)
    assert step.device_type == "cuda"
    x, y = batches(1, device="cuda")[0]
    before = snapshot(model, opt)
    with step:
        loss = loss_of(model, x, y) * float("inf")
    r = step.backward(loss)
    assert r.skipped
    assert not r.stepped
    assert_identical(snapshot(model, opt), before)
    with step:
        loss = loss_of(model, x, y)
    r = step.backward(loss)
    assert r.stepped
    assert r.loss.device.type == "cuda"
