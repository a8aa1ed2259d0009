"""Tests for cudakit.warmup: no-trace warm-up, reserve, warmed(), find_batch_size()."""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import math
import random
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from cudakit._oom import is_oom_error
from cudakit.exceptions import BatchSizeSearchError, CudakitError
from cudakit.warmup import (
    MemoryReserveError,
    ReserveIgnoredWarning,
    WarmupReport,
    find_batch_size,
    preserve_state,
    warmed,
    warmup,
)

# Not `import cudakit.warmup as wu`: once cudakit/__init__.py exports the function `warmup`,
# the attribute cudakit.warmup is the function; the module is in sys.modules.
batch_size = importlib.import_module("cudakit.warmup.batch_size")
_reserve = importlib.import_module("cudakit.warmup.reserve")

# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _fast_free_memory(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full gc.collect() costs ~0.1-0.3 s inside pytest+hypothesis; skip it per try on CPU."""
    if "cuda" not in request.keywords and "real_free" not in request.node.name:
        monkeypatch.setattr(batch_size, "free_memory", lambda: None)


def _bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (so NaN payloads and -0.0 compare bitwise)."""
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), _bits(v))
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    return v


def capture(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Everything the no-trace promise covers, in comparable form."""
    state: dict[str, Any] = {
        "params": {
            n: (
                id(p),
                _value(p),
                p.requires_grad,
                None if p.grad is None else (id(p.grad), _value(p.grad)),
            )
            for n, p in model.named_parameters()
        },
        "buffers": {n: (id(b), _value(b)) for n, b in model.named_buffers()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "cpu_rng": _bits(torch.get_rng_state()),
        "py_rng": random.getstate(),
    }
    if optimizer is not None:
        state["opt"] = _value(optimizer.state_dict())
        state["opt_state_ids"] = {
            id(p): {k: id(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
            for p, s in optimizer.state.items()
        }
        state["opt_groups"] = [
            {k: _value(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
    return state


def small_model(width: int = 6) -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, width), nn.BatchNorm1d(width), nn.Dropout(0.5), nn.ReLU(), nn.Linear(width, 1)
    )


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.randn(n, 1)


class Boom(Exception):
    pass


# --------------------------------------------------------------------------- no-trace property

layers = st.lists(st.sampled_from(["linear", "bn", "dropout", "relu"]), min_size=1, max_size=5)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "layers": draw(layers),
        "opt": draw(st.sampled_from(["adam", "sgd_momentum", "adamw", None])),
        "pre_steps": draw(st.integers(0, 2)),
        "grads": draw(st.sampled_from(["none", "kept", "zeroed"])),
        "frozen": draw(st.booleans()),
        "eval_bn": draw(st.booleans()),
        "steps": draw(st.integers(1, 3)),
        "raise_at": draw(
            st.none()
            | st.tuples(
                st.integers(0, 2), st.sampled_from(["forward", "backward", "step", "interrupt"])
            )
        ),
        "loss_steps_optimizer": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def build(sc: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    torch.manual_seed(sc["seed"])
    mods: list[nn.Module] = [nn.Linear(4, 5)]
    for kind in sc["layers"]:
        mods.append(
            {
                "linear": lambda: nn.Linear(5, 5),
                "bn": lambda: nn.BatchNorm1d(5),
                "dropout": lambda: nn.Dropout(0.3),
                "relu": nn.ReLU,
            }[kind]()
        )
    mods.append(nn.Linear(5, 1))
    model = nn.Sequential(*mods)
    if sc["frozen"]:
        model[0].bias.requires_grad_(False)
    opt: torch.optim.Optimizer | None = None
    params = [p for p in model.parameters() if p.requires_grad]
    if sc["opt"] == "adam":
        opt = torch.optim.Adam(params, lr=1e-2)
    elif sc["opt"] == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    elif sc["opt"] == "sgd_momentum":
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    for _ in range(sc["pre_steps"]):
        mse(model, batch()).backward()
        if opt is not None:
            opt.step()
    if sc["grads"] == "none":
        model.zero_grad(set_to_none=True)
    elif sc["grads"] == "zeroed":
        model.zero_grad(set_to_none=False)
        if sc["pre_steps"] == 0:  # make some grads exist as zero tensors
            for p in params:
                p.grad = torch.zeros_like(p)
    if sc["eval_bn"]:
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.eval()
    return model, opt


@given(scenarios())
def test_warmup_leaves_no_trace(sc: dict[str, Any]) -> None:
    model, opt = build(sc)
    data = batch()
    torch.manual_seed(sc["seed"] + 1)
    random.seed(sc["seed"])
    before = capture(model, opt)
    calls = {"n": 0}

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor | None:
        n = calls["n"]
        calls["n"] += 1
        stage = sc["raise_at"][1] if sc["raise_at"] and sc["raise_at"][0] == n else None
        loss = mse(m, b)
        random.random()
        if stage == "forward":
            raise Boom("after forward")
        if stage == "interrupt":
            raise KeyboardInterrupt
        if not sc["loss_steps_optimizer"] and stage is None:
            return loss
        loss.backward()
        if stage == "backward":
            raise Boom("after backward")
        if opt is not None:
            opt.step()
        if stage == "step":
            raise Boom("after step")
        return None

    raises = sc["raise_at"] is not None and sc["raise_at"][0] < sc["steps"]
    expected: type[BaseException] | None = None
    if raises:
        expected = KeyboardInterrupt if sc["raise_at"][1] == "interrupt" else Boom
    if expected is None:
        report = warmup(model, data, loss_fn=loss_fn, steps=sc["steps"], optimizer=opt)
        assert report.steps == sc["steps"]
        assert report.backward
    else:
        with pytest.raises(expected):
            warmup(model, data, loss_fn=loss_fn, steps=sc["steps"], optimizer=opt)
    assert capture(model, opt) == before


@given(scenarios())
def test_preserve_state_restores_a_real_training_step(sc: dict[str, Any]) -> None:
    model, opt = build(sc)
    before = capture(model, opt)
    with preserve_state(model, opt):
        model.train()
        loss = mse(model, batch())
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.requires_grad_(not p.requires_grad)
    assert capture(model, opt) == before


# --------------------------------------------------------------------------- preserve_state


def test_preserve_state_restores_replaced_tensors_attributes_and_optimizer_shape() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mse(model, batch()).backward()
    opt.step()
    weight = model[0].weight
    before = capture(model, opt)
    lr_before = opt.param_groups[0]["lr"]
    with preserve_state(model, opt, extra=(sched,)):
        model[0].weight = nn.Parameter(torch.zeros(6, 4))
        model.custom_counter = 3
        model[1].running_mean.fill_(7.0)
        opt.param_groups[0]["lr"] = 123.0
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
        opt.state.clear()
        sched.step()
    assert model[0].weight is weight
    assert not hasattr(model, "custom_counter")
    assert opt.param_groups[0]["lr"] == lr_before
    assert len(opt.param_groups) == 1
    assert sched.last_epoch == 0
    assert capture(model, opt) == before


def test_preserve_state_nests_and_decorates_with_a_fresh_snapshot_per_call() -> None:
    model = nn.Linear(2, 2)
    w = model.weight.detach().clone()
    guard = preserve_state(model)

    @guard
    def bump(depth: int) -> float:
        with torch.no_grad():
            model.weight.add_(1.0)
        if depth:
            bump(depth - 1)
        return float(model.weight.detach().sum())

    bump(3)
    assert torch.equal(model.weight, w)
    with preserve_state(model):
        with torch.no_grad():
            model.weight.add_(1)
        with preserve_state(model), torch.no_grad():
            model.weight.add_(1)
        assert torch.equal(model.weight, w + 1)
    assert torch.equal(model.weight, w)


def test_preserve_state_restores_replaced_submodules_and_converted_parameters() -> None:
    model = small_model()
    first, weight = model[0], model[0].weight
    before = capture(model)
    with preserve_state(model):
        model[0] = nn.Linear(4, 6)
        model.append(nn.Linear(1, 1))
        model[4].double()  # `.data` swapped for a float64 tensor
        model[1].to("meta")  # same shape and dtype, other device: copy_ alone would not do
    assert model[0] is first
    assert model[0].weight is weight
    assert len(model) == 5
    assert model[4].weight.dtype == torch.float32
    assert model[1].running_mean.device.type == "cpu"
    assert capture(model) == before


def test_preserve_state_resets_numpy_rng() -> None:
    np = pytest.importorskip("numpy")
    np.random.seed(3)
    expected = np.random.get_state()[1].copy()
    with preserve_state(nn.Linear(1, 1)):
        np.random.rand(10)
    assert (np.random.get_state()[1] == expected).all()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"model": {"w": 1}}, TypeError, r"torch\.nn\.Module, got dict.*not its state_dict"),
        ({"optimizer": "adam"}, TypeError, r"torch\.optim\.Optimizer or None, got str"),
        ({"extra": 3}, TypeError, r"\(extra=\.\.\.\) expects a tuple.*got int 3.*extra=\(obj,\)"),
        (
            {"extra": (object(),)},
            TypeError,
            r"load_state_dict\(\), tensors or torch.Generator objects, got object",
        ),
        ({"model": nn.LazyLinear(2)}, ValueError, r"uninitialized lazy parameters.*forward pass"),
    ],
)
def test_preserve_state_errors(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        preserve_state(**kwargs)


# --------------------------------------------------------------------------- warmup behaviour


def test_warmup_report_on_cpu() -> None:
    model = small_model()
    report = warmup(model, batch(), loss_fn=mse, steps=3)
    assert isinstance(report, WarmupReport)
    assert report.device == torch.device("cpu")
    assert report.steps == 3
    assert len(report.pass_times) == 3
    assert all(t > 0 for t in report.pass_times)
    assert report.first_pass_s == report.pass_times[0]
    assert report.last_pass_s == report.pass_times[-1]
    assert report.speedup == pytest.approx(report.pass_times[0] / report.pass_times[-1])
    assert report.peak_allocated is not None  # the process's peak RSS, as memory_report
    assert report.peak_allocated > 0
    assert report.reserved_after is None
    assert report.reserve_requested is None
    text = str(report)
    assert "3 forward+backward pass(es)" in text
    assert "peak RSS of the process in one step: " in text
    assert "reserved by the caching allocator after: not measured on cpu" in text
    assert json.loads(json.dumps(report.to_dict()))["steps"] == 3


def test_warmup_runs_backward_and_reaches_every_parameter() -> None:
    model = nn.Linear(3, 1)
    seen: list[bool] = []
    model.weight.register_hook(lambda g: seen.append(True))
    report = warmup(model, torch.randn(4, 3), loss_fn=lambda m, x: m(x).sum(), steps=2)
    assert report.backward
    assert seen == [True, True]
    assert model.weight.grad is None


class _LossModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.kind = kind
        self.calls: list[tuple[Any, ...]] = []
        self.count = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        self.calls.append((x.shape, None if y is None else y.shape))
        self.count += 1
        out = self.lin(x)
        loss = out.square().mean()
        if self.kind == "scalar":
            return loss
        if self.kind == "dict":
            return {"loss": loss, "logits": out}
        if self.kind == "attr":
            return type("Output", (), {"loss": loss})()
        return out


@pytest.mark.parametrize(("kind", "backward"), [("scalar", True), ("dict", True), ("attr", True)])
def test_warmup_backpropagates_a_loss_returned_by_the_model(kind: str, backward: bool) -> None:
    model = _LossModel(kind)
    seen: list[bool] = []
    model.lin.weight.register_hook(lambda g: seen.append(True))
    assert warmup(model, torch.randn(3, 2), steps=1).backward is backward
    assert seen == [True]


def test_warmup_forward_only_and_batch_calling_conventions() -> None:
    model = _LossModel("logits")
    x, y = torch.randn(3, 2), torch.randn(3, 1)
    assert warmup(model, x, steps=1).backward is False
    warmup(model, (x, y), steps=1)
    warmup(model, {"x": x, "y": y}, steps=1)
    assert model.count == 0  # rebound attributes are restored too
    assert len(model.calls) == 3  # (but objects mutated in place are not: the promise is shallow)
    calls: list[Any] = []
    model.forward = lambda *a, **k: calls.append((len(a), sorted(k))) or torch.zeros(())  # type: ignore[method-assign]
    warmup(model, x, steps=1)
    warmup(model, (x, y), steps=1)
    warmup(model, {"x": x, "y": y}, steps=1)
    warmup(model, [x, y], steps=1)
    assert calls == [(1, []), (2, []), (0, ["x", "y"]), (1, [])]


def test_warmup_forward_only_under_no_grad_and_inference_mode() -> None:
    model = small_model()
    x = torch.randn(4, 4)
    before = capture(model)
    with torch.no_grad():
        assert warmup(model, x).backward is False
    with torch.inference_mode():
        warmup(model, x)
    assert capture(model) == before


def test_warmup_with_a_dtype_runs_under_autocast() -> None:
    seen: list[tuple[bool, torch.dtype]] = []

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.is_autocast_enabled("cpu"), self.weight.mm(x.t()).dtype))
            return super().forward(x)

    model = Probe(2, 2)
    warmup(model, torch.randn(3, 2), amp=torch.bfloat16, steps=1)
    warmup(model, torch.randn(3, 2), amp=torch.float32, steps=1)
    warmup(model, torch.randn(3, 2), amp=None, steps=1)
    assert seen == [(True, torch.bfloat16), (False, torch.float32), (False, torch.float32)]


def test_warmup_accepts_an_autocast_step_like_object() -> None:
    class FakeStep:
        def __init__(self) -> None:
            self.entered = 0

        def autocast(self) -> torch.autocast:
            self.entered += 1
            return torch.autocast("cpu", dtype=torch.bfloat16)

    amp = FakeStep()
    model = small_model()
    data = batch()
    before = capture(model)
    warmup(model, data, loss_fn=mse, amp=amp, steps=2)
    assert amp.entered == 2
    assert capture(model) == before


def test_warmup_with_the_real_autocast_step_leaves_its_state_untouched() -> None:
    from cudakit.amp import autocast_step

    seen: list[bool] = []

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_autocast_enabled("cpu"))
            return super().forward(x)

    model = nn.Sequential(Probe(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = autocast_step(opt, model=model, dtype=torch.bfloat16, accumulate=2, scheduler=sched)
    train_step = step(mse)
    data = batch()
    train_step(model, data)  # mid-window: grads accumulated, position 1
    assert step.state_dict()["position"] == 1
    before = capture(model, opt)
    step_state = _value(step.state_dict())
    sched_state = copy.deepcopy(sched.state_dict())
    seen.clear()

    def loss_fn(m: nn.Module, b: Any) -> None:
        train_step(m, b)  # completes the window: steps the optimizer and the scheduler

    for amp in (step, train_step):  # the step object, or the function it decorated
        report = warmup(model, data, loss_fn=loss_fn, optimizer=opt, amp=amp, extra=(sched,))
        assert report.backward
        assert capture(model, opt) == before
        assert _value(step.state_dict()) == step_state
        assert sched.state_dict() == sched_state
    assert seen
    assert all(seen)  # the passes ran under the step's autocast


def test_preserve_state_restores_grads_after_an_extra_that_rebinds_them() -> None:
    from cudakit.amp import autocast_step

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autocast_step(opt, dtype=torch.float32, accumulate=2)
    step(mse)(model, batch())
    grads = [p.grad for p in model.parameters()]
    before = capture(model, opt)
    with preserve_state(model, opt, extra=(step,)):
        step(mse)(model, batch())
    # AutocastStep.load_state_dict() sets fresh .grad tensors mid-window; the exact
    # restore runs after it, so the very same grad objects are back.
    assert [p.grad for p in model.parameters()] == grads
    assert capture(model, opt) == before


def test_warmup_extra_is_preserved() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        sched.step()
        return mse(m, b)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
        warmup(model, batch(), loss_fn=loss_fn, optimizer=opt, extra=(sched,))
    assert sched.last_epoch == 0
    assert opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(TypeError, match=r"warmup\(extra=\.\.\.\) expects a tuple"):
        warmup(model, batch(), loss_fn=mse, extra=sched)


def test_warmup_rejects_a_non_scalar_loss_instead_of_skipping_backward() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"loss of shape \(2,\) that requires grad.*`\.mean\(\)`"):
        warmup(model, torch.randn(4, 3), loss_fn=lambda m, x: m(x).square().mean(0))
    with pytest.raises(ValueError, match=r"loss of shape \(4, 2\)"):
        warmup(_LossOutput(model), torch.randn(4, 3))
    assert model.weight.grad is None


class _LossOutput(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.inner(x)}  # forgot to reduce


def test_warmup_under_no_grad_does_not_claim_a_backward() -> None:
    model = nn.Linear(3, 1)
    with torch.no_grad():
        assert warmup(model, torch.randn(4, 3), loss_fn=lambda m, x: m(x).mean()).backward is False
    assert warmup(model, torch.randn(4, 3), loss_fn=lambda m, x: None).backward is True


def test_warmup_never_steps_the_optimizer_itself() -> None:
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    warmup(model, batch(), loss_fn=mse, optimizer=opt)
    assert opt.state_dict()["state"] == {}


def test_warmup_restores_cuda_generators_it_did_not_see_before() -> None:
    # On CPU CUDA never starts, so only the CPU generator matters; the call must not start CUDA.
    warmup(small_model(), batch(), loss_fn=mse)
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


def test_reserve_on_cpu_is_a_warned_no_op() -> None:
    with pytest.warns(ReserveIgnoredWarning, match=r"reserve='80%'.*does nothing on cpu"):
        report = warmup(reserve="80%", device="cpu")
    assert report.reserve_requested is None
    assert report.pass_times == ()
    assert report.first_pass_s is None
    assert report.speedup is None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=ReserveIgnoredWarning)
        warmup(small_model(), batch(), loss_fn=mse, reserve=2**20)
    assert issubclass(ReserveIgnoredWarning, UserWarning)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("80%", ("fraction", 0.8)),
        (" 12.5 % ", ("fraction", 0.125)),
        (0.5, ("fraction", 0.5)),
        (1.0, ("fraction", 1.0)),
        (1024, ("bytes", 1024.0)),
        ("2GiB", ("bytes", 2.0 * 2**30)),
        ("1.5 gb", ("bytes", 1.5e9)),
        ("512MiB", ("bytes", 512.0 * 2**20)),
        ("4096", ("bytes", 4096.0)),
    ],
)
def test_reserve_specs(spec: Any, expected: tuple[str, float]) -> None:
    kind, value = _reserve.parse_reserve(spec)
    assert kind == expected[0]
    assert value == pytest.approx(expected[1])


@pytest.mark.parametrize(
    ("spec", "exc", "match"),
    [
        (True, TypeError, r"^warmup\(reserve=\.\.\.\) expects bytes.*got bool True\. Pass bytes"),
        ([1], TypeError, r"reserve=\.\.\.\) expects bytes.*got list"),
        (0, ValueError, r"reserve=\.\.\.\) expects an int >= 1, got int 0\. An int counts bytes"),
        (-5, ValueError, r"expects an int >= 1, got int -5"),
        (1.5, ValueError, r"expects a finite number in \(0, 1\].*fraction of total device memory"),
        (0.0, ValueError, r"expects a finite number in \(0, 1\], got float 0\.0"),
        ("lots", ValueError, r"expects a size such as '12GiB'.*got str 'lots'.*\"80%\""),
        ("12 parsecs", ValueError, r"expects a size such as"),
        ("150%", ValueError, r"expects a percentage in \(0, 100\]"),
        ("0GiB", ValueError, r"expects a size of at least 1 byte"),
    ],
)
def test_reserve_spec_errors(spec: Any, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        warmup(reserve=spec, device="cpu")


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((), {}, ValueError, r"given nothing to do.*reserve='80%'"),
        ((None, torch.ones(1)), {}, ValueError, r"no model.*warmup\(model, example_batch"),
        ((nn.Linear(1, 1),), {}, ValueError, r"needs something to run: pass example_batch"),
        (("model", torch.ones(1)), {}, TypeError, r"torch\.nn\.Module, got str"),
        (
            (nn.Linear(1, 1), torch.ones(1)),
            {"optimizer": 1},
            TypeError,
            r"Optimizer or None, got int",
        ),
        (
            (nn.Linear(1, 1), torch.ones(1)),
            {"steps": 0},
            ValueError,
            r"steps=\.\.\.\) expects an int >= 1, got int 0",
        ),
        (
            (nn.Linear(1, 1), torch.ones(1)),
            {"steps": 2.0},
            TypeError,
            r"steps=\.\.\.\) expects an int",
        ),
        (
            (nn.Linear(1, 1), torch.ones(1)),
            {"steps": True},
            TypeError,
            r"steps=\.\.\.\) expects an int",
        ),
        ((nn.Linear(1, 1), torch.ones(1)), {"loss_fn": 3}, TypeError, r"loss_fn\(model, batch\)"),
        ((nn.Linear(1, 1), torch.ones(1)), {"amp": "bf16"}, TypeError, r"autocast_step\(\.\.\.\)"),
        ((nn.Linear(1, 1), torch.ones(1)), {"amp": torch.int8}, ValueError, r"not a floating"),
        ((nn.LazyLinear(1), torch.ones(1)), {}, ValueError, r"lazy parameters \(weight"),
        ((nn.Linear(1, 1), torch.ones(1)), {"device": "gpu"}, CudakitError, r"did you mean"),
    ],
)
def test_warmup_errors(
    args: tuple[Any, ...], kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        warmup(*args, **kwargs)


class FakeCudaAllocator:
    """The caching allocator's bookkeeping, enough to test _reserve_cuda on a CPU machine.

    ``reserved`` bytes are held from the driver; freed blocks go back to ``cache`` (not to
    the driver); an allocation is served from a cached block if one is big enough.
    """

    def __init__(self, total: int, used_elsewhere: int, cached: list[int]) -> None:
        self.total = total
        self.used_elsewhere = used_elsewhere
        self.cache = list(cached)
        self.reserved = sum(cached)
        self.live = 0
        self.fail_next = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        props = type("Props", (), {"total_memory": self.total})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: self.reserved)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (self.free(), self.total))
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(torch, "empty", self.empty)

    def free(self) -> int:
        return self.total - self.used_elsewhere - self.reserved

    def empty(self, n: int, **kwargs: Any) -> object:
        if self.fail_next:
            self.cache.clear()  # the real allocator frees its cache and retries
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        fits = [b for b in self.cache if b >= n]
        if fits:
            self.cache.remove(fits[0])
            size = fits[0]
        elif n <= self.free():
            self.reserved += n
            size = n
        else:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        self.live += size
        block = type("Block", (), {})()
        weakref.finalize(block, self._release, size)
        return block

    def _release(self, size: int) -> None:
        self.live -= size
        self.cache.append(size)


CUDA0 = torch.device("cuda", 0)


def test_reserve_grows_the_cache_even_when_a_free_cached_block_would_serve_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alloc = FakeCudaAllocator(total=1000, used_elsewhere=100, cached=[300])
    alloc.install(monkeypatch)
    # 300 held and free in the cache; asking for 500 needs 200 more from the driver. One
    # allocation of 200 would be carved from the cached 300 and grow nothing.
    assert _reserve.reserve_cuda(500, "bytes", 500.0, CUDA0) == 500
    assert alloc.reserved >= 500
    assert alloc.live == 0  # all back in the cache
    assert _reserve.reserve_cuda(0.4, "fraction", 0.4, CUDA0) == 400  # already held: no-op
    assert alloc.reserved == 500


@pytest.mark.parametrize(
    ("spec", "kind", "value", "match"),
    [
        (
            2000,
            "bytes",
            2000.0,
            r"reserve=2000 asks for 1.95 KiB, more than cuda:0 has in total "
            r"\(1000 B\)\. Nothing was allocated\. Ask for less",
        ),
        (
            "95%",
            "fraction",
            0.95,
            r"reserve='95%' asks the caching allocator to hold 950 B on "
            r"cuda:0; it holds 0 B and the device has only 900 B free of 1000 B.*Nothing was "
            r"allocated\. Ask for at most about reserve='90%'",
        ),
    ],
)
def test_impossible_reserve_allocates_nothing(
    monkeypatch: pytest.MonkeyPatch, spec: Any, kind: str, value: float, match: str
) -> None:
    alloc = FakeCudaAllocator(total=1000, used_elsewhere=100, cached=[])
    alloc.install(monkeypatch)
    with pytest.raises(MemoryReserveError, match=match):
        _reserve.reserve_cuda(spec, kind, value, CUDA0)
    assert alloc.reserved == 0


def test_reserve_that_fails_midway_frees_what_it_held(monkeypatch: pytest.MonkeyPatch) -> None:
    alloc = FakeCudaAllocator(total=1000, used_elsewhere=100, cached=[])
    alloc.install(monkeypatch)
    alloc.fail_next = True
    with pytest.raises(
        MemoryReserveError,
        match=r"reserve='50%': 500 B looked free on cuda:0 "
        r"but could not be allocated.*Ask for less",
    ):
        _reserve.reserve_cuda("50%", "fraction", 0.5, CUDA0)
    assert alloc.live == 0


def test_impossible_reserve_is_a_value_error_and_a_cudakit_error() -> None:
    assert issubclass(MemoryReserveError, CudakitError)
    assert issubclass(MemoryReserveError, ValueError)


# --------------------------------------------------------------------------- warmed


def _sgd_step_fn(
    model: nn.Module, opt: torch.optim.Optimizer, calls: list[int]
) -> Callable[..., float]:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        calls.append(1)
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def test_warmed_runs_hidden_warmup_calls_then_exactly_one_real_step() -> None:
    torch.manual_seed(0)
    model = small_model()
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.1)
    calls: list[int] = []
    step = warmed(_sgd_step_fn(model, opt, calls), model=model, optimizer=opt, steps=3)
    x, y = batch()
    torch.manual_seed(1)
    got = step(x, y)
    torch.manual_seed(1)
    want = _sgd_step_fn(twin, twin_opt, [])(x, y)
    assert len(calls) == 4
    assert got == want
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    for (n, b), (_, c) in zip(model.named_buffers(), twin.named_buffers(), strict=True):
        assert torch.equal(b, c), n
    assert _value(opt.state_dict()["state"]) == _value(twin_opt.state_dict()["state"])
    step(x, y)
    assert len(calls) == 5  # no warm-up on later calls


def test_warmed_decorator_form_keeps_the_signature_and_is_thread_safe() -> None:
    model = nn.Linear(2, 1)
    calls: list[int] = []
    lock = threading.Lock()

    @warmed(model=model, steps=2)
    def step(x: torch.Tensor) -> torch.Tensor:
        """Doc."""
        with lock:
            calls.append(1)
        return model(x)

    assert step.__name__ == "step"
    assert step.__doc__ == "Doc."
    threads = [threading.Thread(target=step, args=(torch.ones(1, 2),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2 + 4


def test_warmed_retries_warmup_after_a_failed_first_call() -> None:
    model = nn.Linear(1, 1)
    attempts: list[int] = []

    @warmed(model=model)
    def step() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise Boom("first")

    with pytest.raises(Boom):
        step()
    step()
    assert len(attempts) == 3


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"model": None}, TypeError, r"warmed\(\) needs model="),
        (
            {"model": nn.Linear(1, 1), "steps": 0},
            ValueError,
            r"steps=\.\.\.\) expects an int >= 1, got int 0",
        ),
        ({"model": nn.Linear(1, 1), "optimizer": 3}, TypeError, r"Optimizer or None, got int"),
    ],
)
def test_warmed_errors(kwargs: dict[str, Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        warmed(**kwargs)


def test_warmed_rejects_a_non_callable() -> None:
    with pytest.raises(
        TypeError, match=r"warmed\(func=\.\.\.\) expects a step function to wrap, got int"
    ):
        warmed(model=nn.Linear(1, 1))(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"steps=\.\.\.\) expects an int >= 1, got float 2\.0"):
        warmed(model=nn.Linear(1, 1), steps=2.0)  # type: ignore[call-overload]

    def gen() -> Any:
        yield 1

    async def coro() -> None:
        pass

    for fn in (gen, coro):
        with pytest.raises(TypeError, match=r"cannot wrap the generator or coroutine function"):
            warmed(fn, model=nn.Linear(1, 1))


# --------------------------------------------------------------------------- find_batch_size


class Trial:
    """Raises OutOfMemoryError above ``threshold``; records every size tried."""

    def __init__(self, threshold: int, error: BaseException | None = None) -> None:
        self.threshold = threshold
        self.error = error
        self.tried: list[int] = []

    def __call__(self, batch_size: int) -> int:
        self.tried.append(batch_size)
        if batch_size > self.threshold:
            raise self.error or torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {batch_size} GiB"
            )
        return batch_size


def expected_size(threshold: int, lower: int, upper: int | None, m: int) -> int | None:
    top = threshold if upper is None else min(threshold, upper)
    best = top // m * m
    return best if best >= lower else None


@given(
    threshold=st.integers(0, 5000),
    start=st.integers(1, 3000),
    lower=st.integers(1, 64),
    span=st.none() | st.integers(0, 4000),
    multiple_of=st.sampled_from([1, 2, 3, 8, 64]),
)
def test_find_batch_size_finds_the_largest_fitting_size_in_logarithmic_tries(
    threshold: int, start: int, lower: int, span: int | None, multiple_of: int
) -> None:
    upper = None if span is None else lower + span
    check_search(threshold, start, lower, upper, multiple_of)


def check_search(
    threshold: int, start: int, lower: int, upper: int | None, multiple_of: int
) -> None:
    if upper is not None and -(-lower // multiple_of) * multiple_of > upper:
        with pytest.raises(ValueError, match="no multiple of"):
            find_batch_size(
                Trial(threshold), start=start, lower=lower, upper=upper, multiple_of=multiple_of
            )
        return
    trial = Trial(threshold)
    want = expected_size(threshold, lower, upper, multiple_of)
    if want is None:
        with pytest.raises(BatchSizeSearchError, match=r"not even the lower bound batch size"):
            find_batch_size(trial, start=start, lower=lower, upper=upper, multiple_of=multiple_of)
    else:
        got = find_batch_size(trial, start=start, lower=lower, upper=upper, multiple_of=multiple_of)
        assert got == want
    assert all(b % multiple_of == 0 for b in trial.tried)
    assert all(b >= lower and (upper is None or b <= upper) for b in trial.tried)
    assert len(set(trial.tried)) == len(trial.tried)  # never the same size twice
    # In units of multiple_of: the start and the answer, both clamped to the bounds. Growing
    # or shrinking from one to the other takes |log2(ratio)| + 2 tries at most (the start,
    # and one past the answer), then bisecting a gap no wider than the answer takes at most
    # log2(answer) more.
    k_lo = -(-lower // multiple_of)
    k_hi = math.inf if upper is None else upper // multiple_of
    k_start = min(max(start // multiple_of, k_lo), k_hi)
    k_best = k_lo if want is None else want // multiple_of
    bound = math.ceil(abs(math.log2(k_best / k_start))) + 2 + math.ceil(math.log2(k_best))
    assert len(trial.tried) <= bound, (trial.tried, bound)


def test_find_batch_size_tries_are_logarithmic_where_shrinking_by_ten_percent_is_not() -> None:
    trial = Trial(1000)
    assert find_batch_size(trial, start=1) == 1000
    # 1..512 doubling (10 tries), 1024 fails, then 9 bisection steps.
    assert len(trial.tried) == 20
    trial = Trial(3)
    assert find_batch_size(trial, start=4096) == 3
    assert len(trial.tried) <= 2 * math.ceil(math.log2(4096)) + 2


def test_find_batch_size_respects_upper_and_stops_growing_there() -> None:
    trial = Trial(10**6)
    assert find_batch_size(trial, start=8, upper=100, multiple_of=8) == 96
    assert trial.tried == [8, 16, 32, 64, 96]


def test_find_batch_size_margin() -> None:
    assert find_batch_size(Trial(100), start=16, margin=0.1) == 90
    assert find_batch_size(Trial(100), start=16, margin=0.1, multiple_of=8) == 80
    assert find_batch_size(Trial(5), start=4, lower=4, margin=0.5) == 4  # never below lower


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 20.00 MiB",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
        "non-contiguous input.",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 1099511627776 bytes.",
        "MPS backend out of memory (MPS allocated: 1.2 GB)",
        "HIP out of memory. Tried to allocate 2.00 GiB",
        "XPU out of memory. Tried to allocate 2.00 GiB",
        "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(&handle)`",
        "cuFFT error: CUFFT_ALLOC_FAILED",
    ],
)
def test_oom_like_runtime_errors_shrink_the_batch(message: str) -> None:
    assert is_oom_error(RuntimeError(message))
    assert find_batch_size(Trial(40, RuntimeError(message)), start=64) == 40


def test_is_oom_error_negatives_and_memory_error() -> None:
    assert is_oom_error(MemoryError())
    assert is_oom_error(torch.cuda.OutOfMemoryError("x"))
    assert not is_oom_error(RuntimeError("Expected all tensors to be on the same device"))
    assert not is_oom_error(ValueError("CUDA out of memory"))  # not a RuntimeError
    assert not is_oom_error(KeyboardInterrupt())


def test_other_exceptions_propagate_unchanged() -> None:
    err = ValueError("bad shape")
    trial = Trial(10, err)
    with pytest.raises(ValueError, match="bad shape") as info:
        find_batch_size(trial, start=8)
    assert info.value is err
    assert trial.tried == [8, 16]

    def interrupted(bs: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        find_batch_size(interrupted)


def test_lower_bound_failure_names_the_bound_and_the_fix() -> None:
    with pytest.raises(
        BatchSizeSearchError,
        match=r"lower bound batch size 8 fits in memory \(tried 32, 16, 8; last error: CUDA out "
        r"of memory\. Tried to allocate 8 GiB\)\. Lower `lower=`",
    ):
        find_batch_size(Trial(4), start=32, lower=8)


def test_real_free_memory_runs_between_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    freed: list[int] = []
    real = batch_size.free_memory
    monkeypatch.setattr(batch_size, "free_memory", lambda: freed.append(1) or real())
    trial = Trial(50)
    find_batch_size(trial, start=8)
    assert len(freed) == len(trial.tried)


def test_oom_traceback_tensors_are_released_before_the_next_try_real_free() -> None:
    import weakref

    refs: list[weakref.ref[torch.Tensor]] = []

    def trial(bs: int) -> None:
        if refs:
            assert refs[-1]() is None, "the tensor of the failed try is still alive"
        big = torch.empty(bs)
        refs.append(weakref.ref(big))
        if bs > 4:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    assert find_batch_size(trial, start=16) == 4


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"start": 0}, ValueError, r"start=\.\.\.\) expects an int >= 1, got int 0"),
        ({"start": 2.5}, TypeError, r"start=\.\.\.\) expects an int >= 1, got float"),
        ({"lower": True}, TypeError, r"lower=\.\.\.\) expects an int >= 1, got bool"),
        ({"upper": 0}, ValueError, r"upper=\.\.\.\) expects an int >= 1"),
        ({"lower": 10, "upper": 5}, ValueError, r"upper=5 below lower=10"),
        ({"lower": 9, "upper": 15, "multiple_of": 16}, ValueError, r"no multiple of 16"),
        ({"multiple_of": 0}, ValueError, r"multiple_of=\.\.\.\) expects an int >= 1"),
        (
            {"margin": 1.0},
            ValueError,
            r"margin=\.\.\.\) expects a finite number in \[0, 1\).*e\.g\. margin=0\.1",
        ),
        (
            {"margin": "10%"},
            TypeError,
            r"margin=\.\.\.\) expects a finite number in \[0, 1\), got str",
        ),
    ],
)
def test_find_batch_size_argument_errors(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        find_batch_size(Trial(10), **kwargs)
    with pytest.raises(exc, match=match):
        find_batch_size(**kwargs)


def test_find_batch_size_rejects_a_non_callable_trial() -> None:
    with pytest.raises(
        TypeError, match=r"trial_fn=\.\.\.\) expects a function of the batch size, got int"
    ):
        find_batch_size(3)  # type: ignore[call-overload]


def test_find_batch_size_rejects_generators_and_trials_that_ignore_the_size() -> None:
    def gen(bs: int) -> Any:
        yield torch.empty(bs)

    with pytest.raises(TypeError, match=r"generator or coroutine function: calling it runs "):
        find_batch_size(gen)
    with pytest.raises(TypeError, match=r"decorates a function.*generator or coroutine"):
        find_batch_size()(gen)
    tried: list[int] = []
    with pytest.raises(
        BatchSizeSearchError,
        match=r"still fits at batch size 2147483648 \(tried 1, 2, 4, .*\), so it does not "
        r"seem to use its batch size.*or set upper=",
    ):
        find_batch_size(tried.append, start=1)
    assert len(tried) == 32
    assert find_batch_size(tried.append, start=2**40, upper=2**40) == 2**40  # explicit: fine


# --------------------------------------------------------------------------- decorator form


def test_decorator_returns_the_result_at_the_found_size_with_no_state_between_calls() -> None:
    tried: list[tuple[int, int]] = []

    @find_batch_size(start=8, multiple_of=4)
    def train(batch_size: int, limit: int, *, tag: str = "") -> str:
        """Train."""
        tried.append((batch_size, limit))
        if batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return f"{tag}{batch_size}"

    assert train.__name__ == "train"
    assert train.__doc__ == "Train."
    assert list(inspect.signature(train).parameters) == ["limit", "tag"]
    assert train(50, tag="bs=") == "bs=48"
    first = len(tried)
    assert train(10) == "8"  # a fresh search: starts at 8 again
    assert tried[first] == (8, 10)


def test_decorator_reruns_once_when_margin_moves_the_size() -> None:
    tried: list[int] = []

    @find_batch_size(start=16, margin=0.25)
    def probe(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 64:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert probe() == 48
    assert tried == [16, 32, 64, 128, 96, 80, 72, 68, 66, 65, 48]


def test_decorator_argument_errors() -> None:
    @find_batch_size(start=2)
    def train(batch_size: int, lr: float) -> float:
        return lr

    with pytest.raises(TypeError, match=r"passes the batch size itself; call train\(\.\.\.\)"):
        train(batch_size=3, lr=0.1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"batch size as the first argument.*remaining arguments"):
        train(4, 0.1)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match=r"find_batch_size\(fn=\.\.\.\) expects a function whose first parameter"
    ):
        find_batch_size(start=2)(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"first positional argument, but .*\(\*, bs\) has no"):
        find_batch_size()(lambda *, bs: bs)  # type: ignore[arg-type]


def test_decorator_keeps_no_result_after_a_call() -> None:
    made: list[weakref.ref[torch.Tensor]] = []

    @find_batch_size(start=4, upper=16)
    def probe(batch_size: int) -> torch.Tensor:
        t = torch.zeros(batch_size)
        made.append(weakref.ref(t))
        return t

    assert probe().numel() == 16
    assert all(r() is None for r in made)  # neither the search nor the wrapper holds one


def test_decorator_lower_bound_error_and_passthrough() -> None:
    @find_batch_size(start=4, lower=2)
    def never(batch_size: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(BatchSizeSearchError, match=r"lower bound batch size 2"):
        never()

    @find_batch_size(start=4)
    def broken(batch_size: int) -> None:
        raise KeyError("missing column")

    with pytest.raises(KeyError, match="missing column"):
        broken()


# --------------------------------------------------------------------------- CUDA


def _conv_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def _ce(model: nn.Module, b: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(b[0]), b[1])


@pytest.mark.cuda
def test_cuda_first_pass_is_slower_and_report_has_memory() -> None:
    torch.backends.cudnn.benchmark = True
    try:
        model = _conv_model().cuda()
        b = (torch.randn(64, 3, 32, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda"))
        report = warmup(model, b, loss_fn=_ce, steps=3)
        assert report.device.type == "cuda"
        assert report.first_pass_s is not None
        assert report.last_pass_s is not None
        assert report.first_pass_s > report.last_pass_s
        assert report.peak_allocated is not None
        assert report.peak_allocated > 0
        assert report.reserved_after is not None
        assert report.reserved_after >= report.peak_allocated
    finally:
        torch.backends.cudnn.benchmark = False


@pytest.mark.cuda
def test_cuda_no_trace_includes_cuda_rng_and_grads() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    model = model.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8, device="cuda"), torch.randn(32, 1, device="cuda")
    mse(model, (x, y)).backward()
    opt.step()
    before = capture(model, opt)
    cuda_rng = [_bits(s) for s in torch.cuda.get_rng_state_all()]

    def step(m: nn.Module, b: Any) -> None:
        mse(m, b).backward()
        opt.step()
        torch.rand(10, device="cuda")

    report = warmup(model, (x, y), loss_fn=step, optimizer=opt, amp=torch.bfloat16)
    assert report.peak_allocated is not None
    assert capture(model, opt) == before
    assert [_bits(s) for s in torch.cuda.get_rng_state_all()] == cuda_rng


@pytest.mark.cuda
def test_cuda_reserve_is_held_by_the_caching_allocator() -> None:
    torch.cuda.init()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    want = min(2 * 2**30, free // 4)
    report = warmup(reserve=want, device="cuda")
    assert report.reserve_requested == want
    assert torch.cuda.memory_reserved() >= want
    assert report.reserved_after is not None
    assert report.reserved_after >= want
    allocated = torch.cuda.memory_allocated()
    assert allocated < want  # held in the cache, not allocated to a live tensor
    # A tensor of that size is now served from the cache without growing it.
    reserved = torch.cuda.memory_reserved()
    block = torch.empty(want // 2, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_reserved() == reserved
    del block
    report = warmup(reserve="1%", device="cuda")  # already held: nothing more allocated
    assert torch.cuda.memory_reserved() == reserved
    torch.cuda.empty_cache()


@pytest.mark.cuda
def test_cuda_impossible_reserve_allocates_nothing() -> None:
    torch.cuda.init()
    reserved = torch.cuda.memory_reserved()
    with pytest.raises(MemoryReserveError, match=r"Nothing was allocated"):
        warmup(reserve=1.0, device="cuda")
    assert torch.cuda.memory_reserved() == reserved
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(MemoryReserveError, match=r"more than cuda:0 has in total"):
        warmup(reserve=total + 1, device="cuda")
    assert torch.cuda.memory_reserved() == reserved


@pytest.mark.cuda
def test_cuda_find_batch_size_with_real_out_of_memory() -> None:
    import gc

    torch.cuda.init()
    # find_batch_size collects garbage after an out-of-memory error: CUDA tensors that
    # earlier tests left in reference cycles would go then, below this baseline.
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    unit = total // 16
    tried: list[int] = []
    baseline = torch.cuda.memory_allocated()

    def trial(bs: int) -> None:
        tried.append(bs)
        x = torch.empty(bs * unit, dtype=torch.uint8, device="cuda")
        x.fill_(1)

    found = find_batch_size(trial, start=1)
    assert 1 <= found < 16
    assert (found + 1) in tried or found * 2 in tried
    assert len(tried) <= 10
    assert torch.cuda.memory_allocated() == baseline


def test_loss_module_is_called_as_a_criterion_on_inputs_and_target() -> None:
    """``loss_fn=nn.CrossEntropyLoss()`` works as in a loop: criterion(model(x), y)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    before = copy.deepcopy(model.state_dict())
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    report = warmup(model, (x, y), loss_fn=nn.CrossEntropyLoss(), steps=2)
    assert report.backward
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_loss_module_needs_an_inputs_target_pair() -> None:
    model = nn.Linear(4, 3)
    with pytest.raises(TypeError, match=r"needs example_batch=\(inputs, target\); got Tensor"):
        warmup(model, torch.randn(2, 4), loss_fn=nn.CrossEntropyLoss())
    assert model.weight.grad is None
