"""autocast_step against PyTorch's own mixed-precision and GradScaler tests.

Ported from pytorch test/test_torch.py (the device-generic grad-scaling tests:
test_grad_scaling_autocast, _foreach, _fused, test_grad_scaling_autocast_fused_optimizers,
test_grad_scaling_clipping, test_grad_scaling_clipping_separate_unscale,
test_grad_scaling_penalty, test_grad_scaling_accumulation, test_grad_scaling_multiple,
test_grad_scaling_multigpu, test_grad_scale_will_not_overflow,
test_grad_scaling_state_dict, test_grad_scaling_unscale_sparse,
test_grad_scaling_update_scale, test_grad_scaler_pass_itself), the fused and foreach
optimizer variants of torch/testing/_internal/common_optimizers.py that a CPU runs, and
test/test_autocast.py's CPU op lists (torch/testing/_internal/autocast_test_lists.py).

Every test trains the same model twice: once with torch's hand-written loop
(``torch.autocast("cpu")`` and, for fp16, ``torch.amp.GradScaler("cpu")``), once with
``autocast_step``, and compares weights, gradients, optimizer state and the scaler's
scale and growth tracker bit for bit. torch's tests compare against an fp32 control run
with tolerances; here both runs do the same arithmetic, so nothing is tolerated. For
bf16 (no scaler) the hand-written loop skips a step whose gradients are not finite, as
torch's control loop skips its known-bad iteration. Optimizers that skip on the device
(torch's fused ones) run both ways a step can skip them: on the host (the CPU's way)
and through ``found_inf`` with lazily read verdicts (the GPU's way, forced here).

Where cudakit deliberately differs from the torch recipe, the test says so and checks
the documented behaviour instead: clipping always unscales first, several optimizers
share one verdict, and a fused SGD with momentum whose first step is skipped starts
from a fresh state (torch's own loop leaves its uninitialised momentum buffer).
"""

from __future__ import annotations

import copy
import pickle
from itertools import chain
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from port_torch_amp import (
    OPTIMIZER_VARIANTS,
    SKIP_ITER,
    Clock,
    Pair,
    assert_same_pair,
    assert_same_scaler,
    assert_same_training,
    finite_grads,
    grad_scaler,
    inject_inf,
    is_fused,
    make_pair,
    scaling_data,
    two_layers,
)
from torch import nn

import cudakit.amp._stepper as amp_stepper
from cudakit.amp import AutocastStep, StepResult, autocast_step

FP16, BF16 = torch.float16, torch.bfloat16
DTYPES = [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")]


def _paths(variants: list[str]) -> list[Any]:
    """(variant, path) params: fused optimizers both ways they skip, others once."""
    params = []
    for v in variants:
        for path in ("host", "device") if is_fused(v) else ("host",):
            params.append(pytest.param(v, path, id=f"{v}-{path}"))
    return params


def _take_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With path "device", steps built from now on take the GPU's sync-free path."""
    if path == "device":
        monkeypatch.setattr(amp_stepper, "host_read_waits", lambda device_type: True)


def _scaler_for(dtype: torch.dtype, **overrides: Any) -> torch.amp.GradScaler | None:
    return grad_scaler(**overrides) if dtype == FP16 else None


def _mse_step(
    pair: Pair, dtype: torch.dtype, scaler: torch.amp.GradScaler | None, **kw: Any
) -> tuple[AutocastStep, Any]:
    """The step over ``pair.ours`` and its decorated MSE function (torch's loss)."""
    step = autocast_step(pair.ours_opt, dtype=dtype, scaler=scaler, **kw)
    return step, step(lambda x, y: F.mse_loss(pair.ours(x), y))


def _torch_iteration(
    pair: Pair,
    scaler: torch.amp.GradScaler | None,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype,
    *,
    max_norm: float | None = None,
) -> torch.Tensor | None:
    """One iteration of torch's run(): zero_grad, autocast forward, (scaled) backward, step.

    fp16 follows torch's scaling API (``unscale_`` first when it clips);
    bf16 is torch's control loop: it steps only when the gradients are finite. Returns
    the total norm clipping saw (with ``max_norm``).
    """
    model, opt = pair.ref, pair.ref_opt
    norm = None
    opt.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        loss = F.mse_loss(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        if max_norm is not None:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm, error_if_nonfinite=False
            )
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        finite = finite_grads(model)
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if finite:
            opt.step()
    return norm


def _check_scaled_grads(pair: Pair, result: StepResult) -> None:
    """A fused step torch skipped keeps the *scaled* gradients (the kernel unscales only
    when it steps); cudakit unscales before it decides, so it holds them unscaled."""
    inv = torch.reciprocal(result.scale.double()).float()  # GradScaler's inv_scale
    for p, q in zip(pair.ref.parameters(), pair.ours.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad * inv)


# --------------------------------------------------------------------------- autocast


AUTOCAST_VARIANTS = list(OPTIMIZER_VARIANTS)


@pytest.mark.parametrize(("variant", "path"), _paths(AUTOCAST_VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_autocast(
    variant: str, path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's _grad_scaling_autocast_test (plain, foreach and fused optimizers): four
    iterations, an inf gradient on iteration 2; three steps, one skip, the scale grown
    three times and backed off once."""
    _take_path(path, monkeypatch)
    pair = make_pair(variant, inf_at={SKIP_ITER})
    ref_scaler, scaler = _scaler_for(dtype), _scaler_for(dtype)
    step, train = _mse_step(pair, dtype, scaler)
    for i, (x, y) in enumerate(scaling_data()):
        pair.clock.now = i
        used = None if ref_scaler is None else ref_scaler.get_scale()
        _torch_iteration(pair, ref_scaler, x, y, dtype)
        result = train(x, y)
        skipped = i == SKIP_ITER
        assert bool(result.skipped) is skipped
        fused_skip = skipped and is_fused(variant) and scaler is not None
        assert_same_pair(pair, grads=not fused_skip, where=f"iteration {i}")
        if fused_skip:
            _check_scaled_grads(pair, result)
        if ref_scaler is None:
            assert result.scale is None
        else:
            assert scaler is not None
            assert result.scale is not None
            assert_same_scaler(ref_scaler, scaler)
            assert result.scale.item() == used  # the scale this iteration used
    assert (step.steps, step.skipped_steps) == (3, 1)
    if scaler is not None:
        assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5


@pytest.mark.parametrize("variant", ["SGD-momentum", "Adam-foreach", "AdamW-fused"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_autocast_pickled(variant: str, dtype: torch.dtype) -> None:
    """torch's try_pickle: the scaler goes through pickle after every iteration. Here the
    step's state does, into a fresh step with a default GradScaler each time."""
    pair = make_pair(variant, inf_at={SKIP_ITER})
    ref_scaler = _scaler_for(dtype)
    step, _ = _mse_step(pair, dtype, _scaler_for(dtype))
    for i, (x, y) in enumerate(scaling_data()):
        pair.clock.now = i
        _torch_iteration(pair, ref_scaler, x, y, dtype)
        if ref_scaler is not None:
            ref_scaler = pickle.loads(pickle.dumps(ref_scaler))
        state = pickle.loads(pickle.dumps(step.state_dict()))
        fresh = torch.amp.GradScaler("cpu") if dtype == FP16 else None
        step, train = _mse_step(pair, dtype, fresh)
        step.load_state_dict(state)
        train(x, y)
        fused_skip = i == SKIP_ITER and is_fused(variant) and dtype == FP16
        assert_same_pair(pair, grads=not fused_skip)
        if ref_scaler is not None:
            assert step.scaler is not None
            assert_same_scaler(ref_scaler, step.scaler)
    assert (step.steps, step.skipped_steps) == (3, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_disabled(dtype: torch.dtype) -> None:
    """_run_scaling_case's enabled=False: the same loop with scaling and autocast off is
    plain fp32 (torch injects no inf then), and the disabled scaler's scale reads 1."""
    pair = make_pair("Adam")
    ref_scaler = torch.amp.GradScaler("cpu", enabled=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step = autocast_step(pair.ours_opt, dtype=dtype, enabled=False, scaler=scaler)
    train = step(lambda x, y: F.mse_loss(pair.ours(x), y))
    assert (step.enabled, step.dtype, step.scaler) == (False, torch.float32, None)
    for x, y in scaling_data():
        pair.ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=False):
            loss = F.mse_loss(pair.ref(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(pair.ref_opt)
        ref_scaler.update()
        train(x, y)
        assert_same_pair(pair)
    assert ref_scaler.get_scale() == scaler.get_scale() == 1.0


def test_grad_scaling_growth_tracker() -> None:
    """test_grad_scaling_update_scale over a loop: growth every 2nd clean step, a backoff of
    0.25 on each inf (which resets the tracker); tracker and scale equal every iteration."""
    settings = {"init_scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.25}
    pair = make_pair("SGD-momentum", inf_at={3, 6}, lr=0.1)
    ref_scaler = grad_scaler(growth_interval=2, **settings)
    scaler = grad_scaler(growth_interval=2, **settings)
    _, train = _mse_step(pair, FP16, scaler)
    for i, (x, y) in enumerate(scaling_data(batches=8)):
        pair.clock.now = i
        _torch_iteration(pair, ref_scaler, x, y, FP16)
        train(x, y)
        assert_same_scaler(ref_scaler, scaler)
        assert_same_pair(pair)
    assert scaler._get_growth_tracker() == 1
    assert scaler.get_scale() == 4.0 * 2.0 * 0.25 * 2.0 * 0.25


# --------------------------------------------------------------------------- fused optimizers


FUSED_VARIANTS = [v for v in OPTIMIZER_VARIANTS if is_fused(v)]


@pytest.mark.parametrize(("variant", "path"), _paths(FUSED_VARIANTS))
@pytest.mark.parametrize("separate_unscale", [False, True], ids=["step-unscales", "unscale_"])
def test_grad_scaling_autocast_fused_optimizers(
    variant: str, path: str, separate_unscale: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's test_grad_scaling_autocast_fused_optimizers: a fused optimizer under
    GradScaler(init_scale=128), its step unscaling inside the kernel or after
    ``unscale_``; loss, gradients, weights and state (step counts too) every iteration."""
    _take_path(path, monkeypatch)
    pair = make_pair(variant)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    step, train = _mse_step(pair, FP16, scaler)
    for x, y in scaling_data():
        pair.ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.mse_loss(pair.ref(x), y)
        ref_scaler.scale(loss).backward()
        if separate_unscale:
            ref_scaler.unscale_(pair.ref_opt)
        ref_scaler.step(pair.ref_opt)
        ref_scaler.update()
        result = train(x, y)
        assert torch.equal(result.loss, loss.detach())
        assert_same_pair(pair)
        assert_same_scaler(ref_scaler, scaler)
    assert step.steps == 4


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("inf_at", [{0}, {0, 1}], ids=["first", "first-two"])
def test_fused_sgd_momentum_first_step_skipped_starts_fresh(
    path: str, inf_at: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused SGD with momentum whose first step is skipped. torch's fused kernel, told to
    skip through found_inf, leaves the momentum buffer it allocated with ``empty_like``
    uninitialised, so torch's own loop goes on from garbage. cudakit reads the verdict
    before such a first step and never runs it: the state is a fresh optimizer's, the
    same as a hand-written loop that skips the step on the host."""
    _take_path(path, monkeypatch)
    pair = make_pair("SGD-nesterov-fused", inf_at=inf_at, lr=0.1)
    ref_scaler, scaler = grad_scaler(), grad_scaler()
    step, train = _mse_step(pair, FP16, scaler)
    for i, (x, y) in enumerate(scaling_data()):
        pair.clock.now = i
        pair.ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.mse_loss(pair.ref(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(pair.ref_opt)
        found = sum(f.item() for f in ref_scaler._found_inf_per_device(pair.ref_opt).values())
        if not found:
            ref_scaler.step(pair.ref_opt)
        ref_scaler.update()
        result = train(x, y)
        assert bool(result.skipped) is (i in inf_at)
        if i in inf_at:
            assert pair.ours_opt.state == {}, "a skipped first step left state behind"
        assert_same_pair(pair, grads=i not in inf_at)
        assert_same_scaler(ref_scaler, scaler)
    assert step.skipped_steps == len(inf_at)


class _ScalingAwareSGD(torch.optim.Optimizer):
    """SGD that unscales and skips itself from ``grad_scale``/``found_inf``, as fused
    optimizers do (torch's test_grad_scaler_pass_itself). It counts its real steps per
    parameter on the device, undoing the count of a skipped one as fused Adam does."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True
        self.calls: list[tuple[bool, bool]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self.calls.append((grad_scale is not None, found_inf is not None))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if grad_scale is None else p.grad / grad_scale
                update = grad * group["lr"]
                state = self.state[p]
                steps = state.setdefault("steps", torch.zeros(()))
                if found_inf is None:
                    steps.add_(1)
                else:
                    update = torch.where(found_inf > 0, torch.zeros_like(update), update)
                    steps.add_(1 - found_inf.clamp(max=1))
                p.sub_(update)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaler_pass_itself(
    path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An optimizer of one's own that declares ``_step_supports_amp_scaling`` gets the
    scaler's ``found_inf`` (and ``grad_scale``, None once unscaled) and skips itself; it
    trains as under torch's GradScaler (bf16: a loop that skips non-finite steps)."""
    _take_path(path, monkeypatch)
    torch.manual_seed(0)
    ref = two_layers()
    ours = copy.deepcopy(ref)
    ref_opt, ours_opt = (
        _ScalingAwareSGD(ref.parameters(), 0.5),
        _ScalingAwareSGD(ours.parameters(), 0.5),
    )
    clock = Clock()
    inject_inf([ref[1].weight, ours[1].weight], clock, {SKIP_ITER})
    pair = Pair(ref, ours, ref_opt, ours_opt, clock)
    ref_scaler, scaler = _scaler_for(dtype), _scaler_for(dtype)
    step, train = _mse_step(pair, dtype, scaler)
    assert step.sync_free
    for i, (x, y) in enumerate(scaling_data()):
        clock.now = i
        _torch_iteration(pair, ref_scaler, x, y, dtype)
        result = train(x, y)
        assert bool(result.skipped) is (i == SKIP_ITER)
        # torch's loop hands this optimizer scaled gradients it does not write back
        assert_same_pair(pair, grads=dtype != FP16)
    # every call that reached the optimizer had no grad_scale (cudakit unscales first)
    assert not any(scaled for scaled, _ in ours_opt.calls)
    if path == "device":
        # the first step (it makes the optimizer's state) read the verdict on the host;
        # then the skip happened inside the optimizer, through found_inf
        assert len(ours_opt.calls) == 4
        assert all(found for _, found in ours_opt.calls[1:])
    else:  # the CPU skips on the host: the skipped step never called the optimizer
        assert len(ours_opt.calls) == 3


# --------------------------------------------------------------------------- clipping


CLIP_VARIANTS = ["SGD", "SGD-momentum-foreach", "Adam", "AdamW-fused", "Adagrad-fused"]


@pytest.mark.parametrize(("variant", "path"), _paths(CLIP_VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_clipping_separate_unscale(
    variant: str, path: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's test_grad_scaling_clipping_separate_unscale: ``unscale_``, then
    ``clip_grad_norm_(max_norm=0.2, error_if_nonfinite=False)``, then the step; the inf
    of iteration 2 is skipped. ``max_grad_norm=0.2`` does the same. On the skipped
    iteration torch's loop has clipped the inf gradients to NaN; fp16's step leaves them
    unscaled but unclipped (it decides before clipping), so they are compared after the
    clean iterations only."""
    _take_path(path, monkeypatch)
    pair = make_pair(variant, inf_at={SKIP_ITER})
    ref_scaler, scaler = _scaler_for(dtype), _scaler_for(dtype)
    step, train = _mse_step(pair, dtype, scaler, max_grad_norm=0.2)
    for i, (x, y) in enumerate(scaling_data()):
        pair.clock.now = i
        norm = _torch_iteration(pair, ref_scaler, x, y, dtype, max_norm=0.2)
        result = train(x, y)
        assert bool(result.skipped) is (i == SKIP_ITER)
        assert_same_pair(pair, grads=i != SKIP_ITER, where=f"iteration {i}")
        if i == SKIP_ITER and path == "device":  # learnt of the skip later (docs)
            assert result.grad_norm is not None
            assert not bool(torch.isfinite(result.grad_norm))
        elif i == SKIP_ITER:
            assert result.grad_norm is None
        else:  # the norm before clipping, as clip_grad_norm_ returned it
            assert result.grad_norm is not None
            assert norm is not None
            assert torch.equal(result.grad_norm, norm)
        if scaler is not None:
            assert ref_scaler is not None
            assert_same_scaler(ref_scaler, scaler)
    assert (step.steps, step.skipped_steps) == (3, 1)


def test_grad_scaling_clipping() -> None:
    """torch's test_grad_scaling_clipping clips the *scaled* gradients to
    ``max_norm * scale`` without unscaling. cudakit always unscales first (torch's
    recommended recipe, bit for bit above), so the clipping coefficient differs by the
    1e-6 of clip_grad_norm_'s denominator: the same skips and scales, the weights within
    torch's own tolerance (atol 1e-5)."""
    pair = make_pair("SGD", inf_at={SKIP_ITER})
    ref_scaler, scaler = grad_scaler(), grad_scaler()
    step, train = _mse_step(pair, FP16, scaler, max_grad_norm=0.2)
    for i, (x, y) in enumerate(scaling_data()):
        pair.clock.now = i
        pair.ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = F.mse_loss(pair.ref(x), y)
        ref_scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), 0.2 * ref_scaler.get_scale())
        ref_scaler.step(pair.ref_opt)
        ref_scaler.update()
        assert bool(train(x, y).skipped) is (i == SKIP_ITER)
        assert_same_scaler(ref_scaler, scaler)
        for p, q in zip(pair.ref.parameters(), pair.ours.parameters(), strict=True):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-5)
    assert (step.steps, step.skipped_steps) == (3, 1)


# --------------------------------------------------------------------------- gradient penalty


def _penalized(
    loss: torch.Tensor, params: list[nn.Parameter], scaler: torch.amp.GradScaler | None
) -> torch.Tensor:
    """torch's gradient-penalty recipe: the gradients of the (scaled) loss with
    ``create_graph=True``, unscaled by hand, their norm added to the loss."""
    if scaler is not None:
        scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grads = [g * inv_scale for g in scaled]
    else:
        grads = list(torch.autograd.grad(loss, params, create_graph=True))
    norm = grads[0].pow(2).sum()
    for g in grads[1:]:
        norm = norm + g.pow(2).sum()
    return loss + norm.sqrt()


@pytest.mark.parametrize("variant", ["SGD-momentum", "Adam-foreach", "AdamW-fused"])
@pytest.mark.parametrize("form", ["decorated", "explicit"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_penalty(variant: str, form: str, dtype: torch.dtype) -> None:
    """torch's test_grad_scaling_penalty (the recipe of torch's AMP examples): the penalty
    uses ``torch.autograd.grad(..., create_graph=True)`` on the loss scaled by the step's
    own scaler (``step.scaler``); the step then scales and backpropagates the penalized
    loss. Both forms train bit for bit as the hand-written loop, the inf of iteration 2
    (it reaches the penalty's gradients too) skipped."""
    pair = make_pair(variant, inf_at={SKIP_ITER})
    ref_scaler, scaler = _scaler_for(dtype), _scaler_for(dtype)
    step = autocast_step(pair.ours_opt, dtype=dtype, scaler=scaler)
    params = list(pair.ours.parameters())

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _penalized(F.mse_loss(pair.ours(x), y), params, step.scaler)

    ref_params = list(pair.ref.parameters())
    for i, (x, y) in enumerate(scaling_data()):
        pair.clock.now = i
        pair.ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(pair.ref(x), y)
        with torch.autocast("cpu", dtype=dtype):  # torch's recipe: penalty under autocast
            loss = _penalized(loss, ref_params, ref_scaler)
        if ref_scaler is not None:
            ref_scaler.scale(loss).backward()
            ref_scaler.step(pair.ref_opt)
            ref_scaler.update()
        else:
            loss.backward()
            if finite_grads(pair.ref):
                pair.ref_opt.step()
        if form == "decorated":
            result = train(x, y)
        else:
            with step:
                loss = F.mse_loss(pair.ours(x), y)
            with step.autocast():
                loss = _penalized(loss, params, step.scaler)
            result = step.backward(loss)
        assert bool(result.skipped) is (i == SKIP_ITER)
        fused_skip = i == SKIP_ITER and is_fused(variant) and scaler is not None
        assert_same_pair(pair, grads=not fused_skip, where=f"iteration {i}")
        if scaler is not None:
            assert ref_scaler is not None
            assert_same_scaler(ref_scaler, scaler)
    assert (step.steps, step.skipped_steps) == (3, 1)


# --------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize(("variant", "path"), _paths(["SGD-momentum", "Adam", "AdamW-fused"]))
@pytest.mark.parametrize(
    "inf_at", [(), (1,), (2,)], ids=["clean", "inf-2nd-micro", "inf-1st-micro"]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_accumulation(
    variant: str,
    path: str,
    inf_at: tuple[int, ...],
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's test_grad_scaling_accumulation: each loss divided by 2, scaled and
    backpropagated; step, update and zero_grad on every 2nd batch (three windows of six
    batches here). ``accumulate=2`` does the same; an inf in either micro-step of the
    first or second window skips that window."""
    _take_path(path, monkeypatch)
    pair = make_pair(variant, inf_at=inf_at)
    ref_scaler, scaler = _scaler_for(dtype), _scaler_for(dtype)
    step, train = _mse_step(pair, dtype, scaler, accumulate=2)
    for i, (x, y) in enumerate(scaling_data(batches=6)):
        pair.clock.now = i
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(pair.ref(x), y) / 2
        if ref_scaler is not None:
            ref_scaler.scale(loss).backward()
        else:
            loss.backward()
        result = train(x, y)
        if (i + 1) % 2 == 0:
            if ref_scaler is not None:
                ref_scaler.step(pair.ref_opt)
                ref_scaler.update()
            elif finite_grads(pair.ref):
                pair.ref_opt.step()
            window_bad = bool({i - 1, i} & set(inf_at))
            assert result.stepped is not window_bad
            assert bool(result.skipped) is window_bad
            fused_skip = window_bad and is_fused(variant) and scaler is not None
            assert_same_pair(pair, grads=not fused_skip, where=f"window ending {i}")
            pair.ref_opt.zero_grad()
            if scaler is not None:
                assert ref_scaler is not None
                assert_same_scaler(ref_scaler, scaler)
        else:
            assert not result.stepped
            assert_same_pair(pair, where=f"micro-step {i}")
    assert (step.steps, step.skipped_steps) == (3 - len(inf_at), len(inf_at))


# --------------------------------------------------------------------------- several optimizers


def _two_model_losses(
    m0: nn.Module, m1: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    out0, out1 = m0(x), m1(x)
    return F.mse_loss(0.3 * out0 + 0.7 * out1, y), F.mse_loss(0.6 * out0 - 0.4 * out1, y)


def _multiple_case(kwargs: dict[str, Any], inf_at: set[int]):
    torch.manual_seed(0)
    ref0, ref1 = two_layers(), two_layers()
    ours0, ours1 = copy.deepcopy(ref0), copy.deepcopy(ref1)
    clock = Clock()
    inject_inf([ref1[1].weight, ours1[1].weight], clock, inf_at)

    def opts(m0: nn.Module, m1: nn.Module) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(m0.parameters(), lr=1.0, **kwargs),
            torch.optim.Adam(m1.parameters(), lr=0.1, **kwargs),
        ]

    return (ref0, ref1, opts(ref0, ref1)), (ours0, ours1, opts(ours0, ours1)), clock


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        ({}, "host"),
        ({"foreach": True}, "host"),
        ({"fused": True}, "host"),
        ({"fused": True}, "device"),
    ],
    ids=["plain", "foreach", "fused-host", "fused-device"],
)
@pytest.mark.parametrize("inf_at", [{SKIP_ITER}, {0}], ids=["inf-iter2", "inf-iter0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_multiple(
    kwargs: dict[str, Any],
    path: str,
    inf_at: set[int],
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's test_grad_scaling_multiple: two models, two optimizers, both fed by two
    losses, one ``unscale_`` done separately. cudakit takes one loss per step and one
    verdict for all its optimizers, so the hand-written loop here backpropagates the
    sum of the two losses and skips both optimizers when either has an inf."""
    _take_path(path, monkeypatch)
    (ref0, ref1, ref_opts), (ours0, ours1, ours_opts), clock = _multiple_case(kwargs, inf_at)
    ref_scaler, scaler = _scaler_for(dtype), _scaler_for(dtype)
    step = autocast_step(ours_opts, dtype=dtype, scaler=scaler)

    @step
    def train(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss0, loss1 = _two_model_losses(ours0, ours1, x, y)
        return loss0 + loss1

    for i, (x, y) in enumerate(scaling_data()):
        clock.now = i
        for opt in ref_opts:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss0, loss1 = _two_model_losses(ref0, ref1, x, y)
        if ref_scaler is not None:
            ref_scaler.scale(loss0 + loss1).backward()
            found = 0.0
            for opt in ref_opts:
                ref_scaler.unscale_(opt)
                found += sum(f.item() for f in ref_scaler._found_inf_per_device(opt).values())
            if not found:
                for opt in ref_opts:
                    ref_scaler.step(opt)
            ref_scaler.update()
        else:
            (loss0 + loss1).backward()
            if finite_grads(ref0, ref1):
                for opt in ref_opts:
                    opt.step()
        result = train(x, y)
        assert bool(result.skipped) is (i in inf_at)
        for (r, ro), (o, oo) in zip(
            [(ref0, ref_opts[0]), (ref1, ref_opts[1])],
            [(ours0, ours_opts[0]), (ours1, ours_opts[1])],
            strict=True,
        ):
            assert_same_training(r, ro, o, oo, grads=i not in inf_at, where=f"iteration {i}")
        if scaler is not None:
            assert ref_scaler is not None
            assert_same_scaler(ref_scaler, scaler)
    assert (step.steps, step.skipped_steps) == (3, 1)
    if scaler is not None:
        assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5  # torch's assertion


def test_grad_scaling_multiple_one_verdict_for_all_optimizers() -> None:
    """Where cudakit differs from torch's recipe on purpose: torch's GradScaler keeps one
    found_inf per optimizer, so with an inf only in model 1 torch's loop still steps
    optimizer 0. autocast_step's optimizers all step or all skip together (docs: "one
    inf/NaN verdict")."""
    (ref0, ref1, ref_opts), (ours0, ours1, ours_opts), clock = _multiple_case({}, {0})
    ref_scaler, scaler = grad_scaler(), grad_scaler()
    before = [p.detach().clone() for p in ours0.parameters()]
    train = autocast_step(ours_opts, dtype=FP16, scaler=scaler)(
        lambda x, y: sum(_two_model_losses(ours0, ours1, x, y))
    )
    x, y = scaling_data(batches=1)[0]
    clock.now = 0
    with torch.autocast("cpu", dtype=FP16):
        loss0, loss1 = _two_model_losses(ref0, ref1, x, y)
    ref_scaler.scale(loss0).backward(retain_graph=True)
    ref_scaler.scale(loss1).backward()
    ref_scaler.unscale_(ref_opts[0])
    ref_scaler.step(ref_opts[0])
    ref_scaler.step(ref_opts[1])
    ref_scaler.update()
    result = train(x, y)
    assert result.skipped
    moved = [not torch.equal(p, b) for p, b in zip(ref0.parameters(), before, strict=True)]
    assert all(moved), "torch's loop steps the optimizer without an inf"
    assert all(torch.equal(p, b) for p, b in zip(ours0.parameters(), before, strict=True))
    assert_same_scaler(ref_scaler, scaler)  # one backoff either way


@pytest.mark.multigpu
def test_grad_scaling_multigpu() -> None:
    """torch's test_grad_scaling_multigpu: two models on two GPUs, one step over both
    optimizers; an inf on one device skips both (one verdict), as a loop that checks
    both devices' found_inf does."""
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    torch.manual_seed(0)
    ref0, ref1 = two_layers().to(dev0), two_layers().to(dev1)
    ours0, ours1 = copy.deepcopy(ref0), copy.deepcopy(ref1)
    clock = Clock()
    inject_inf([ref1[1].weight, ours1[1].weight], clock, {SKIP_ITER})
    ref_opts = [
        torch.optim.SGD(ref0.parameters(), lr=1.0),
        torch.optim.SGD(ref1.parameters(), lr=1.0),
    ]
    ours_opts = [
        torch.optim.SGD(ours0.parameters(), lr=1.0),
        torch.optim.SGD(ours1.parameters(), lr=1.0),
    ]
    settings = {"init_scale": 128.0, "growth_factor": 2.0, "growth_interval": 1}
    ref_scaler = torch.amp.GradScaler("cuda", **settings)
    scaler = torch.amp.GradScaler("cuda", **settings)

    def losses(m0: nn.Module, m1: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out0, out1 = m0(x.to(dev0)), m1(x.to(dev1)).to(dev0)
        y = y.to(dev0)
        return F.mse_loss(0.3 * out0 + 0.7 * out1, y) + F.mse_loss(0.6 * out0 - 0.4 * out1, y)

    step = autocast_step(ours_opts, dtype=FP16, scaler=scaler)
    train = step(lambda x, y: losses(ours0, ours1, x, y))
    for i, (x, y) in enumerate(scaling_data()):
        clock.now = i
        for opt in ref_opts:
            opt.zero_grad()
        with torch.autocast("cuda", dtype=FP16):
            loss = losses(ref0, ref1, x, y)
        ref_scaler.scale(loss).backward()
        found = 0.0
        for opt in ref_opts:
            ref_scaler.unscale_(opt)
            found += sum(f.item() for f in ref_scaler._found_inf_per_device(opt).values())
        if not found:
            for opt in ref_opts:
                ref_scaler.step(opt)
        ref_scaler.update()
        assert bool(train(x, y).skipped) is (i == SKIP_ITER)
        for p, q in zip(
            chain(ref0.parameters(), ref1.parameters()),
            chain(ours0.parameters(), ours1.parameters()),
            strict=True,
        ):
            assert torch.equal(p, q)
    assert scaler.get_scale() == 128.0 * 2.0**3 * 0.5


# --------------------------------------------------------------------------- scaler state


def test_grad_scale_will_not_overflow() -> None:
    """torch's test_grad_scale_will_not_overflow: init_scale 1e38 and growth 16 overflow
    the scaled loss; the step is skipped and the scale backs off instead of growing to
    inf, as in torch's loop."""
    torch.manual_seed(0)
    ref = nn.Linear(5, 1)
    ours = copy.deepcopy(ref)
    ref_opt, ours_opt = torch.optim.Adam(ref.parameters()), torch.optim.Adam(ours.parameters())
    settings = {"growth_interval": 1, "growth_factor": 2.0**4, "init_scale": 1e38}
    ref_scaler = torch.amp.GradScaler("cpu", **settings)
    scaler = torch.amp.GradScaler("cpu", **settings)
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)
    with torch.autocast("cpu", dtype=FP16):
        loss = ((ref(x) - y) ** 2).mean()
    ref_scaler.scale(loss).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    result = autocast_step(ours_opt, dtype=FP16, scaler=scaler)(
        lambda x, y: ((ours(x) - y) ** 2).mean()
    )(x, y)
    assert bool(torch.isfinite(scaler._scale).all())
    assert result.skipped
    assert_same_scaler(ref_scaler, scaler)
    assert_same_training(ref, ref_opt, ours, ours_opt, grads=False)


@pytest.mark.parametrize("lazy_init_scale", [True, False], ids=["scale-made", "scale-lazy"])
def test_grad_scaling_state_dict(lazy_init_scale: bool) -> None:
    """torch's test_grad_scaling_state_dict through the step's own state: a step whose
    scaler has other settings (and a stray ``_init_growth_tracker``) takes the saved
    step's scale, factors, interval and growth tracker, whether its scale tensor exists
    yet or not."""
    model = nn.Linear(4, 1)
    s0 = torch.amp.GradScaler(
        "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2
    )
    s1 = torch.amp.GradScaler(
        "cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1
    )
    s1._init_growth_tracker = 7  # a value load_state_dict must overwrite
    saved = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), dtype=FP16, scaler=s0)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), dtype=FP16, scaler=s1)
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
        assert isinstance(s1._scale, torch.Tensor)
    step.load_state_dict(saved.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0


# --------------------------------------------------------------------------- sparse gradients


class _Bag(nn.Module):
    """An embedding with sparse gradients and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).float().pow(2).mean()


SPARSE_VARIANTS = {
    "SGD": (torch.optim.SGD, {}),
    "SGD-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {}),
}


@pytest.mark.parametrize("variant", list(SPARSE_VARIANTS))
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("inf_at", [(), (2,)], ids=["clean", "inf-iter2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_scaling_unscale_sparse(
    variant: str, accumulate: int, inf_at: tuple[int, ...], dtype: torch.dtype
) -> None:
    """torch's test_grad_scaling_unscale_sparse, through a training loop: an embedding's
    sparse gradients are unscaled and checked (one inf value skips the step), with the
    optimizers that take sparse gradients, and accumulated across micro-steps."""
    cls, kwargs = SPARSE_VARIANTS[variant]
    torch.manual_seed(0)
    ref = _Bag()
    ours = copy.deepcopy(ref)
    ref_opt, ours_opt = (
        cls(ref.parameters(), lr=0.1, **kwargs),
        cls(ours.parameters(), lr=0.1, **kwargs),
    )
    clock = Clock()
    inject_inf([ref.emb.weight, ours.emb.weight], clock, inf_at)
    ref_scaler, scaler = _scaler_for(dtype), _scaler_for(dtype)
    step = autocast_step(ours_opt, dtype=dtype, scaler=scaler, accumulate=accumulate)
    train = step(lambda idx: ours(idx))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 10, (6,), generator=g) for _ in range(4)]
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        for i, idx in enumerate(batches):
            clock.now = i
            with torch.autocast("cpu", dtype=dtype):
                loss = ref(idx) / accumulate
            (ref_scaler.scale(loss) if ref_scaler is not None else loss).backward()
            result = train(idx)
            if (i + 1) % accumulate:
                continue
            if ref_scaler is not None:
                ref_scaler.step(ref_opt)
                ref_scaler.update()
            elif finite_grads(ref):
                ref_opt.step()
            bad = any(j in inf_at for j in range(i + 1 - accumulate, i + 1))
            assert bool(result.skipped) is bad
            assert_same_training(ref, ref_opt, ours, ours_opt, grads=not bad, where=f"{i}")
            ref_opt.zero_grad()
    assert step.skipped_steps == len(inf_at)


@pytest.mark.parametrize("dtype", [*DTYPES, pytest.param(torch.float32, id="fp32")])
def test_uncoalesced_sparse_gradient_that_overflows_is_skipped(dtype: torch.dtype) -> None:
    """torch's uncoalesced case: a sparse gradient whose duplicate entries are finite but
    whose coalesced sum overflows. It is non-finite (Adagrad, which coalesces it, turns
    the weights NaN), so every precision skips the step and the weights stay as they
    were (docs: a non-finite gradient never reaches the weights, in fp16, bf16 and fp32
    alike). GradScaler's ``unscale_`` coalesces only fp16 gradients before its check."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)

    def overflowing(grad: torch.Tensor) -> torch.Tensor:
        twice = torch.tensor([[1, 1]])  # row 1, twice: 3e38 + 3e38 is inf in float32
        return torch.sparse_coo_tensor(twice, torch.full((2, 4), 3e38), grad.shape)

    emb.weight.register_hook(overflowing)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if dtype == FP16 else None
    step = autocast_step(opt, dtype=dtype, scaler=scaler)
    before = emb.weight.detach().clone()
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        result = step(lambda idx: emb(idx).float().sum())(torch.tensor([1, 2]))
    assert result.skipped
    assert torch.equal(emb.weight, before)
    assert opt.state[emb.weight]["step"] == 0


# --------------------------------------------------------------------------- autocast op lists


def _autocast_ops(low: torch.dtype) -> dict[str, torch.Tensor]:
    """A few ops of each of test_autocast.py's CPU lists, on fixed inputs."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    m0, m1, m2 = rnd(8, 8), rnd(8, 8), rnd(8, 8)
    b0, b1, b2 = rnd(4, 8, 8), rnd(4, 8, 8), rnd(4, 8, 8)
    l0, l1 = rnd(8, 8, dtype=low), rnd(8, 8, dtype=low)
    probs = torch.rand(8, 8, generator=g).to(low)
    return {
        # torch_16 / nn_16: run in the autocast dtype
        "mm": torch.mm(m0, m1),
        "matmul": torch.matmul(m0, m1),
        "bmm": torch.bmm(b0, b1),
        "addmm": torch.addmm(m2, m0, m1),
        "baddbmm": torch.baddbmm(b2, b0, b1),
        "conv1d": F.conv1d(b0, b1),
        "conv2d": F.conv2d(rnd(2, 3, 8, 8), rnd(4, 3, 3, 3)),
        "prelu": F.prelu(rnd(8), rnd(1)),
        "linear": F.linear(m0, m1),
        # torch_fp32 / nn_fp32: run in float32 whatever they get
        "mse_loss": F.mse_loss(l0, l1),
        "l1_loss": F.l1_loss(l0, l1),
        "smooth_l1_loss": F.smooth_l1_loss(l0, l1),
        "huber_loss": F.huber_loss(l0, l1),
        "binary_cross_entropy_with_logits": F.binary_cross_entropy_with_logits(l0, probs),
        "nll_loss": F.nll_loss(l0, torch.zeros(8, dtype=torch.long)),
        "margin_ranking_loss": F.margin_ranking_loss(l0, l1, torch.ones(8, 8, dtype=low)),
        # torch_need_autocast_promote: widest input type
        "cat": torch.cat([rnd(8, dtype=low), rnd(8)]),
        "stack": torch.stack([rnd(8, dtype=low), rnd(8)]),
        # torch_expect_builtin_promote
        "add": rnd(8) + rnd(8, dtype=low),
        "mul": rnd(8) * rnd(8, dtype=low),
        "eq": rnd(8) == rnd(8, dtype=low),
    }


_EXPECTED_FP32 = {
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy_with_logits",
    "nll_loss",
    "margin_ranking_loss",
    "cat",
    "stack",
    "add",
    "mul",
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_cpu_op_lists(dtype: torch.dtype) -> None:
    """test_autocast.py's CPU lists inside a step: 16-bit ops run in the step's dtype,
    fp32 ops in float32, promoting ops in the widest type, with the same values as
    under ``torch.autocast("cpu", dtype)``; in the decorated form, the explicit form and
    ``step.autocast()``."""
    with torch.autocast("cpu", dtype=dtype):
        want = _autocast_ops(dtype)
    for name, out in want.items():
        expected = (
            torch.bool if name == "eq" else torch.float32 if name in _EXPECTED_FP32 else dtype
        )
        assert out.dtype == expected, name
    model = nn.Linear(8, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), dtype=dtype)
    seen: list[dict[str, torch.Tensor]] = []

    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        seen.append(_autocast_ops(dtype))
        return model(x).float().mean()

    train(torch.randn(2, 8))
    with step:
        seen.append(_autocast_ops(dtype))
        loss = model(torch.randn(2, 8)).float().mean()
    step.backward(loss)
    with step.autocast():
        seen.append(_autocast_ops(dtype))
    for got in seen:
        assert got.keys() == want.keys()
        for name, out in got.items():
            assert out.dtype == want[name].dtype, name
            assert torch.equal(out, want[name]), name


def test_autocast_cpu_fp32_dtype_runs_every_op_in_float32() -> None:
    """test_autocast.py's autocast with dtype=torch.float32 on the CPU changes nothing:
    ``dtype=torch.float32`` is a step with autocast off, every op as without autocast."""
    want = _autocast_ops(torch.float32)
    model = nn.Linear(8, 1)
    step = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float32)
    assert (step.enabled, step.scaler) == (False, None)
    seen: list[dict[str, torch.Tensor]] = []

    @step
    def train(x: torch.Tensor) -> torch.Tensor:
        seen.append(_autocast_ops(torch.float32))
        return model(x).mean()

    train(torch.randn(2, 8))
    for name, out in seen[0].items():
        assert out.dtype == want[name].dtype, name
        assert torch.equal(out, want[name]), name
