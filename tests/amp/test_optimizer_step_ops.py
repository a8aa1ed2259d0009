"""The optimizer calls a step makes for the user: ``zero_grad`` and ``step``.

cudakit calls torch's own ``Optimizer.zero_grad`` loop and the optimizer's own ``step``
without torch's per-call profiler scope (``record_function``) while no profiler
records: that scope costs more than the non-finite guard on a small model. Everything
else those calls do must still happen: hooks, overrides, the LR scheduler's bookkeeping,
and the annotations while a profiler records.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from hypothesis import given, settings
from hypothesis import strategies as st

import cudakit.amp as amp
from cudakit.amp._ops import optimizer_step, zero_grad


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _fill_grads(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)


@contextmanager
def _scopes() -> Iterator[list[str]]:
    """The names of the ``record_function`` scopes entered inside the block."""
    names: list[str] = []
    real = torch.autograd.profiler.record_function

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, name: str, args: str | None = None) -> None:
            names.append(name)
            super().__init__(name, args)

    torch.autograd.profiler.record_function = Counting  # type: ignore[misc]
    try:
        yield names
    finally:
        torch.autograd.profiler.record_function = real  # type: ignore[misc]


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"])
def test_optimizer_step_equals_step_bit_for_bit(name: str) -> None:
    ma, mb = _model(), _model()
    cls = getattr(torch.optim, name)
    oa, ob = cls(ma.parameters(), lr=0.1), cls(mb.parameters(), lr=0.1)
    for _ in range(3):
        _fill_grads(ma)
        _fill_grads(mb)
        oa.step()
        optimizer_step(ob)
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert str(oa.state_dict()) == str(ob.state_dict())


def test_optimizer_step_and_zero_grad_enter_no_profiler_scope() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _fill_grads(model)
    with _scopes() as names:
        opt.step()
        opt.zero_grad()
    assert names == ["Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"]
    _fill_grads(model)
    with _scopes() as names:
        optimizer_step(opt)
        zero_grad(opt)
    assert names == []
    assert all(p.grad is None for p in model.parameters())


def test_autocast_step_enters_no_optimizer_profiler_scope() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    @amp.autocast_step(opt, dtype=torch.float32)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    with _scopes() as names:
        for _ in range(3):
            assert step(torch.ones(2, 4)).stepped
    assert not [n for n in names if n.startswith("Optimizer.")]


def test_profiler_still_sees_step_and_zero_grad() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    @amp.autocast_step(opt, dtype=torch.float32)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    step(torch.ones(2, 4))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(torch.ones(2, 4))
        step(torch.ones(2, 4))
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#AdamW.step" in names
    assert "Optimizer.zero_grad#AdamW.zero_grad" in names


def test_step_hooks_run_in_order_with_their_arguments() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[tuple[str, Any, Any, Any]] = []
    handles = [
        optimizer_module.register_optimizer_step_pre_hook(
            lambda o, a, k: calls.append(("global pre", o, a, k))
        ),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o, a, k))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o, a, k))),
        optimizer_module.register_optimizer_step_post_hook(
            lambda o, a, k: calls.append(("global post", o, a, k))
        ),
    ]
    try:
        _fill_grads(model)
        opt.step()
        expected = list(calls)
        calls.clear()
        _fill_grads(model)
        optimizer_step(opt)
    finally:
        for h in handles:
            h.remove()
    assert [c[0] for c in calls] == ["global pre", "pre", "post", "global post"]
    assert [(c[0], c[1], c[2], c[3]) for c in calls] == [(c[0], c[1], c[2], c[3]) for c in expected]


def test_a_pre_hook_that_rewrites_the_arguments_is_honoured() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[object] = []

    class Recording(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            seen.append(closure)
            return super().step()

    opt = Recording(model.parameters(), lr=0.1)

    def closure() -> None:
        return None

    handle = opt.register_step_pre_hook(lambda o, a, k: ((o,), {"closure": closure}))
    try:
        _fill_grads(model)
        optimizer_step(opt)
    finally:
        handle.remove()
    assert seen == [closure]


def test_overridden_and_patched_steps_are_called() -> None:
    calls: list[str] = []

    class Custom(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            calls.append("class")
            return super().step(closure)

    model = _model()
    opt = Custom(model.parameters(), lr=0.1)
    _fill_grads(model)
    optimizer_step(opt)
    assert calls == ["class"]

    bound = opt.step

    def patched(*args: Any, **kwargs: Any) -> Any:
        calls.append("instance")
        return bound(*args, **kwargs)

    opt.step = patched  # type: ignore[method-assign]
    optimizer_step(opt)
    assert calls == ["class", "instance", "class"]


def test_overridden_zero_grad_is_called() -> None:
    calls: list[bool | None] = []

    class Custom(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    model = _model()
    opt = Custom(model.parameters(), lr=0.1)
    _fill_grads(model)
    zero_grad(opt)
    assert calls == [True]
    assert all(p.grad is None for p in model.parameters())


def test_scheduler_sees_the_optimizer_step() -> None:
    """The LR scheduler's step() must not warn that the optimizer never stepped."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    @amp.autocast_step(opt, scheduler=sched, dtype=torch.float32)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _scopes() as names:
            for _ in range(3):
                step(torch.ones(2, 4))
    assert getattr(opt, "_opt_called", True)
    assert sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert "Optimizer.step#SGD.step" not in names


def test_step_returns_the_closure_value() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _fill_grads(model)
    assert optimizer_step(opt) is None


def test_a_post_hook_registered_during_the_step_runs_as_torch_runs_it() -> None:
    """torch looks the post-hooks up after step() returns: one added inside it runs too."""

    def train(use_cudakit: bool) -> list[str]:
        calls: list[str] = []

        class Lazy(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:  # type: ignore[override]
                if not self._optimizer_step_post_hooks:
                    self.register_step_post_hook(lambda o, a, k: calls.append("post"))
                return super().step(closure)

        model = _model()
        opt = Lazy(model.parameters(), lr=0.1)
        for _ in range(3):
            _fill_grads(model)
            if use_cudakit:
                optimizer_step(opt)
            else:
                opt.step()
        return calls

    assert train(True) == train(False)
    assert len(train(False)) == 6  # Lazy's wrapper and SGD's (inside super().step()) run it


def test_a_global_post_hook_registered_during_the_step_runs() -> None:
    model = _model()
    calls: list[str] = []
    handles: list[Any] = []

    class Lazy(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            if not handles:
                handles.append(
                    optimizer_module.register_optimizer_step_post_hook(
                        lambda o, a, k: calls.append("global post")
                    )
                )
            return torch.optim.SGD.step.__wrapped__(self, closure)  # type: ignore[attr-defined]

    opt = Lazy(model.parameters(), lr=0.1)
    try:
        _fill_grads(model)
        optimizer_step(opt)
    finally:
        for h in handles:
            h.remove()
    assert calls == ["global post"]


def test_execution_trace_through_the_profiler_keeps_the_step_scope(tmp_path: Any) -> None:
    """The documented way to record an execution trace sees cudakit's optimizer steps."""
    import json

    from torch.profiler import ExecutionTraceObserver

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = amp.autocast_step(opt, dtype=torch.float32)
    path = tmp_path / "et.json"
    et = ExecutionTraceObserver().register_callback(str(path))
    try:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], execution_trace_observer=et
        ):
            with step:
                loss = model(torch.ones(3, 4)).sum()
            step.backward(loss)
    finally:
        et.unregister_callback()
    nodes = json.loads(path.read_text())["nodes"]
    assert "Optimizer.step#AdamW.step" in [n["name"] for n in nodes]


_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"momentum": 0.9}),
    "SGD fused": (torch.optim.SGD, {"momentum": 0.9, "fused": True}),
    "Adam": (torch.optim.Adam, {}),
    "AdamW foreach": (torch.optim.AdamW, {"foreach": True}),
    "AdamW fused": (torch.optim.AdamW, {"fused": True}),
    "RMSprop": (torch.optim.RMSprop, {"momentum": 0.5}),
    "Adagrad": (torch.optim.Adagrad, {}),
    "NAdam": (torch.optim.NAdam, {}),
}


@given(
    name=st.sampled_from(sorted(_OPTIMIZERS)),
    maximize=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01]),
    scheduler=st.booleans(),
    hook_at=st.one_of(st.none(), st.integers(0, 3)),
    steps=st.integers(1, 4),
)
@settings(max_examples=40, deadline=None)
def test_optimizer_step_trains_like_step(
    name: str,
    maximize: bool,
    weight_decay: float,
    scheduler: bool,
    hook_at: int | None,
    steps: int,
) -> None:
    """Property: over optimizers, options, schedulers and a hook added mid-run,
    ``optimizer_step`` leaves weights, state, learning rates and hook calls as ``step()``."""

    def train(call: Any) -> tuple[list[torch.Tensor], str, list[float], int]:
        model = _model()
        cls, options = _OPTIMIZERS[name]
        opt = cls(
            model.parameters(), lr=0.05, weight_decay=weight_decay, maximize=maximize, **options
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if scheduler else None
        calls: list[int] = []
        for i in range(steps):
            if i == hook_at:
                opt.register_step_post_hook(lambda o, a, k: calls.append(1))
            torch.manual_seed(i)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            call(opt)
            if sched is not None:
                sched.step()
        lrs = [g["lr"] for g in opt.param_groups]
        return (
            [p.detach().clone() for p in model.parameters()],
            str(opt.state_dict()),
            lrs,
            len(calls),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # also: no "scheduler before optimizer" warning
        mine = train(optimizer_step)
        theirs = train(lambda o: o.step())
    assert all(torch.equal(a, b) for a, b in zip(mine[0], theirs[0], strict=True))
    assert mine[1:] == theirs[1:]


class _CountingScaler(torch.amp.GradScaler):
    """A GradScaler subclass: cudakit must leave its step() to it."""

    def __init__(self) -> None:
        super().__init__("cpu", init_scale=1024.0)
        self.steps = 0

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        self.steps += 1
        return super().step(optimizer, *args, **kwargs)


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_step_matches_the_scaler_loop_without_the_scope(fused: bool) -> None:
    """fp16 with GradScaler("cpu"): bit for bit with the hand-written scaler loop, a skip
    included, and (non-fused) no optimizer profiler scope on clean steps."""

    def batches() -> list[torch.Tensor]:
        torch.manual_seed(3)
        xs = [torch.randn(4, 4) for _ in range(4)]
        xs[2] = xs[2].clone()
        xs[2][0, 0] = float("inf")
        return xs

    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x in batches():
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)

    @amp.autocast_step(
        opt, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0)
    )
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).float().pow(2).mean()

    skipped = []
    with _scopes() as names:
        for x in batches():
            skipped.append(step(x).skipped)
    assert skipped == [False, False, True, False]
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert str(ref_opt.state_dict()) == str(opt.state_dict())
    assert step.autocast_step.scaler.get_scale() == scaler.get_scale()
    if not fused:
        assert "Optimizer.step#Adam.step" not in names


def test_a_scaler_subclass_keeps_its_own_step() -> None:
    model = _model()
    scaler = _CountingScaler()

    @amp.autocast_step(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).float().sum()

    for _ in range(3):
        step(torch.ones(2, 4))
    assert scaler.steps == 3
