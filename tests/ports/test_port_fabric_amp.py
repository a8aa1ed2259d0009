"""autocast_step against Lightning Fabric's mixed-precision tests.

Ported from Lightning Fabric tests_fabric/plugins/precision/test_amp.py
(test_amp_precision_default_scaler, test_amp_precision_scaler_with_bf16_type,
test_amp_precision_forward_context, test_amp_precision_parameter_validation),
tests_fabric/plugins/precision/test_amp_integration.py (test_amp,
test_amp_fused_optimizer_parity), tests_fabric/strategies/test_single_device.py
(_run_test_clip_gradients, norm) and tests_fabric/test_fabric.py (backward and
optimizer step: MixedPrecision's recipe of torch.autocast + GradScaler, by hand).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cudakit.amp import autocast_step
from cudakit.exceptions import NonFiniteStepsError

TORCH_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "32-true": torch.float32}


def _sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr)


def _scaler(precision: str) -> dict[str, Any]:
    """A CPU GradScaler with a small initial scale, for precision="16-mixed"."""
    if precision != "16-mixed":
        return {}
    return {"scaler": torch.amp.GradScaler("cpu", init_scale=256.0)}


def _data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)
    ]


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _params_close(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_default_scaler_for_fp16_none_for_bf16() -> None:
    lin = nn.Linear(2, 2)
    fp16 = autocast_step(_sgd(lin), dtype="16-mixed")
    assert fp16.dtype == torch.float16
    assert isinstance(fp16.scaler, torch.amp.GradScaler)
    bf16 = autocast_step(_sgd(lin), dtype="bf16-mixed")
    assert bf16.dtype == torch.bfloat16
    assert bf16.scaler is None


def test_scaler_with_bf16_refused() -> None:
    with pytest.raises(ValueError, match="loss scaling is only for float16"):
        autocast_step(_sgd(nn.Linear(2, 2)), dtype="bf16-mixed", scaler=torch.amp.GradScaler("cpu"))


def test_forward_context() -> None:
    step = autocast_step(_sgd(nn.Linear(2, 2)), dtype="bf16-mixed")
    assert step.device_type == "cpu"
    ctx = step.autocast()
    assert isinstance(ctx, torch.autocast)
    assert ctx.fast_dtype == torch.bfloat16
    with ctx:
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("16x", ValueError, "not a precision cudakit knows"),
        ("bf17", ValueError, "not a precision cudakit knows"),
        ("float64-mixed", ValueError, "not a precision cudakit knows"),
        (16.5, TypeError, "expects a torch.dtype"),
        # Fabric's "true" precisions hold the weights in that dtype: not autocast_step's job.
        ("bf16-true", ValueError, "asks for weights held in that precision"),
        ("16-true", ValueError, "asks for weights held in that precision"),
    ],
)
def test_parameter_validation(bad: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        autocast_step(_sgd(nn.Linear(2, 2)), dtype=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16),
        ("32-true", torch.float32),
        ("no", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("fp32", torch.float32),
    ],
)
def test_precision_names(name: str, expected: torch.dtype) -> None:
    assert autocast_step(_sgd(nn.Linear(2, 2)), dtype=name).dtype == expected


class MixedPrecisionModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert torch.is_autocast_enabled("cpu")
        out = self.layer(x)
        self.seen.append(out.dtype)
        return out


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("form", ["decorator", "explicit"])
def test_amp(precision: str, form: str) -> None:
    torch.manual_seed(0)
    model = MixedPrecisionModule()
    step = autocast_step(
        torch.optim.Adam(model.parameters(), lr=0.1), dtype=precision, **_scaler(precision)
    )
    before = model.layer.weight.detach().clone()
    batch = torch.rand(2, 32)
    if form == "decorator":
        res = step(lambda x: F.mse_loss(model(x).float(), torch.ones(2, 2)))(batch)
    else:
        with step:
            loss = F.mse_loss(model(batch).float(), torch.ones(2, 2))
        res = step.backward(loss)
    assert model.seen == [TORCH_DTYPES[precision]]
    assert model.layer.weight.dtype == torch.float32
    assert model.layer.weight.grad is not None
    assert model.layer.weight.grad.dtype == torch.float32
    assert res.stepped
    assert not res.skipped
    assert not torch.equal(before, model.layer.weight)
    assert (res.scale is not None) == (precision == "16-mixed")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_amp_fused_optimizer_parity(precision: str) -> None:
    def run(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(1234)
        model = nn.Linear(10, 10)
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, fused=fused)
        step = autocast_step(optimizer, dtype=precision, **_scaler(precision))
        data, target = torch.randn(10, 10), torch.randn(10, 10)
        fn = step(lambda: (model(data).float() - target).abs().sum())
        losses = [fn().loss.float() for _ in range(5)]
        assert step.steps == 5
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    losses, params = run(fused=False)
    fused_losses, fused_params = run(fused=True)
    torch.testing.assert_close(losses, fused_losses)
    for a, b in zip(params, fused_params, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_clip_gradients_norm(precision: str) -> None:
    """SGD with lr=1, so the update is the clipped gradient; the gradient stays clipped."""
    in_features, out_features = 32, 2
    model = nn.Linear(in_features, out_features, bias=False)
    model.weight.data.fill_(0.01)
    batch = torch.full((1, in_features), 0.1)
    norm = 0.1 * math.sqrt(in_features * out_features)  # every gradient entry is 0.1
    step = autocast_step(
        _sgd(model, lr=1.0), dtype=precision, max_grad_norm=norm / 2, **_scaler(precision)
    )
    w0 = model.weight.detach().clone()
    res = step(lambda: model(batch).float().sum())()
    assert res.stepped
    assert res.grad_norm is not None
    tol = {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(res.grad_norm.float(), torch.tensor(norm), **tol)
    assert model.weight.grad is not None
    grad_norm = torch.linalg.vector_norm(model.weight.grad.float())
    torch.testing.assert_close(grad_norm, torch.tensor(norm / 2), **tol)
    update = torch.linalg.vector_norm((w0 - model.weight.detach()).float())
    torch.testing.assert_close(update, torch.tensor(norm / 2), **tol)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("fused", [False, True])
def test_recipe_parity(precision: str, accumulate: int, clip: float | None, fused: bool) -> None:
    """The same training as the hand-written autocast + GradScaler loop Fabric runs."""
    ref = _classifier()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    dtype = TORCH_DTYPES[precision]
    mixed = dtype != torch.float32
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=dtype == torch.float16)
    for i, (x, y) in enumerate(_data()):
        with torch.autocast("cpu", dtype=dtype, enabled=mixed):
            loss = F.cross_entropy(ref(x), y) / accumulate
        scaler.scale(loss).backward()
        if (i + 1) % accumulate == 0:
            scaler.unscale_(ref_opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            scaler.step(ref_opt)
            scaler.update()
            ref_sched.step()
            ref_opt.zero_grad()
    step = autocast_step(
        opt,
        dtype=precision,
        accumulate=accumulate,
        max_grad_norm=clip,
        scheduler=sched,
        **_scaler(precision),
    )
    fn = step(lambda x, y: F.cross_entropy(model(x), y))
    for x, y in _data():
        fn(x, y)
    assert step.steps == 8 // accumulate
    assert sched.last_epoch == ref_sched.last_epoch
    _params_close(ref, model)


def test_default_gradscaler_parity() -> None:
    """16-mixed without scaler=: the same as torch's default GradScaler by hand."""
    torch.manual_seed(0)
    ref = nn.Linear(6, 3)
    model = copy.deepcopy(ref)
    data = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(4)]
    ref_opt = _sgd(ref)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(ref(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
    fn = autocast_step(_sgd(model), dtype="16-mixed")(lambda x, y: F.mse_loss(model(x).float(), y))
    for x, y in data:
        fn(x, y)
    _params_close(ref, model)


def test_multiple_param_groups_and_two_optimizers_parity() -> None:
    ref = _classifier()
    model = copy.deepcopy(ref)

    def optimizers(m: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        groups = [{"params": m[0].parameters(), "lr": 0.1}, {"params": [m[2].weight], "lr": 0.01}]
        return torch.optim.SGD(groups, momentum=0.9), torch.optim.Adam([m[2].bias], lr=1e-2)

    ref_a, ref_b = optimizers(ref)
    for x, y in _data(4):
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for opt in (ref_a, ref_b):
            opt.step()
            opt.zero_grad()
    step = autocast_step(list(optimizers(model)), dtype="fp32", max_grad_norm=0.5)
    fn = step(lambda x, y: F.cross_entropy(model(x), y))
    for x, y in _data(4):
        fn(x, y)
    _params_close(ref, model)


def test_token_weighted_accumulation_equals_big_batch() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(5, 1)
    model = copy.deepcopy(ref)
    xs = [torch.randn(3, 5), torch.randn(7, 5)]
    ys = [torch.randn(3, 1), torch.randn(7, 1)]
    ref_opt = _sgd(ref)
    F.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    ref_opt.step()
    step = autocast_step(_sgd(model), dtype="fp32", accumulate=2)
    fn = step(lambda x, y: {"loss": F.mse_loss(model(x), y, reduction="sum"), "weight": x.shape[0]})
    results = [fn(x, y) for x, y in zip(xs, ys, strict=True)]
    assert [bool(r.stepped) for r in results] == [False, True]
    _params_close(ref, model)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_skip_nonfinite_step(precision: str, clip: float | None) -> None:
    """A non-finite step changes nothing: parameters, optimizer state, scheduler."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    step = autocast_step(
        opt, dtype=precision, max_grad_norm=clip, scheduler=sched, **_scaler(precision)
    )
    before = [p.detach().clone() for p in model.parameters()]
    fn = step(lambda x: model(x).float().sum() * x.sum())
    res = fn(torch.full((2, 4), float("inf")))
    assert res.skipped
    assert not res.stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(opt.state) == 0
    assert sched.last_epoch == 0
    assert (step.skipped_steps, step.steps) == (1, 0)
    res2 = fn(torch.ones(2, 4))
    assert res2.stepped
    assert sched.last_epoch == 1
    if precision == "16-mixed":
        assert float(res2.scale) < float(res.scale)  # backed off


def test_buffers_restored_on_skip() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    step = autocast_step(_sgd(model), model=model, dtype="fp32")
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    res = step(lambda x: model(x).sum() * float("nan"))(torch.randn(3, 4))
    assert res.skipped
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k


def test_max_skipped_raises() -> None:
    model = nn.Linear(2, 1)
    step = autocast_step(_sgd(model), dtype="fp32", max_skipped=3)
    fn = step(lambda: model(torch.ones(1, 2)).sum() * float("inf"))
    for _ in range(2):
        assert fn().skipped
    with pytest.raises(NonFiniteStepsError, match="skipped 3 optimizer steps in a row"):
        fn()


def test_loss_without_grad_refused() -> None:
    step = autocast_step(_sgd(nn.Linear(2, 1)))
    with pytest.raises(ValueError, match="does not require grad"):
        step(lambda: torch.tensor(1.0))()
