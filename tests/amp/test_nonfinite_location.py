"""Naming the first producer of an inf/NaN: ``find_nonfinite`` and
``autocast_step(locate_nonfinite=True)``, each case named correctly, with nothing changed."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudakit.amp.watch as amp_watch
from cudakit.amp import NonFiniteSource, NonFiniteWarning, autocast_step, find_nonfinite

NAN = float("nan")


class Act(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * NAN if self.bad else torch.tanh(x)


class Block(nn.Module):
    """Linear, BatchNorm, dropout, an activation; poisoned on request in several places."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.2)
        self.act = Act()
        self.mode: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.mode == "own code":
            h = h * NAN
        if self.mode == "tensor hook":
            h.register_hook(lambda g: g * NAN)
        return self.act(self.drop(self.bn(h)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.block = Block()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.enc(x)))  # type: ignore[no-any-return]


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _poison(model: Net, where: str) -> Any:
    """Make ``model`` produce a NaN at ``where``; returns a hook handle to remove, or None."""
    if where == "block.act forward":
        model.block.act.bad = True
    elif where == "block forward":
        model.block.mode = "own code"
    elif where == "block tensor hook":
        model.block.mode = "tensor hook"
    elif where == "block.lin backward hook":
        return model.block.lin.register_full_backward_hook(lambda m, gi, go: (gi[0] * NAN,))
    return None


def _cure(model: Net, handle: Any) -> None:
    model.block.act.bad = False
    model.block.mode = None
    if handle is not None:
        handle.remove()


EXPECTED = {
    "block.act forward": ("forward", "block.act", "Act", None),
    "block forward": ("forward", "block", "Block", None),
    "block tensor hook": ("backward", "block", "Block", "a tensor hook"),
    "block.lin backward hook": ("backward", "block.lin", "Linear", "BackwardHookFunctionBackward"),
}


def _everything(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What the user owns: weights, buffers, .grad, optimizer state, every RNG."""
    out: dict[str, Any] = {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "grad_ids": [id(p.grad) for p in model.parameters()],
        "cpu_rng": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
        "training": [m.training for m in model.modules()],
    }
    if opt is not None:
        out["opt"] = [
            {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for s in opt.state.values()
        ]
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    def same(x: torch.Tensor, y: torch.Tensor) -> bool:  # bit for bit, NaNs included
        return x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8),
                                                  y.view(-1).view(torch.uint8))  # fmt: skip

    assert a.keys() == b.keys()
    for k in a["state"]:
        assert same(a["state"][k], b["state"][k]), k
    for x, y in zip(a["grads"], b["grads"], strict=True):
        assert (x is None and y is None) or same(x, y)
    assert a["grad_ids"] == b["grad_ids"]
    assert torch.equal(a["cpu_rng"], b["cpu_rng"])
    assert a["random"] == b["random"]
    assert np.array_equal(a["numpy"], b["numpy"])
    assert a["training"] == b["training"]
    for sa, sb in zip(a.get("opt", []), b.get("opt", []), strict=True):
        assert all(same(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("where", list(EXPECTED))
def test_find_nonfinite_names_the_producer_and_changes_nothing(where: str) -> None:
    model = _net()
    x, y = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.mse_loss(model(x), y).backward()
    opt.step()  # optimizer state and .grad to keep
    handle = _poison(model, where)
    before = _everything(model, opt)
    source = find_nonfinite(lambda a, b: F.mse_loss(model(a), b), x, y)
    _assert_same(before, _everything(model, opt))
    _cure(model, handle)
    assert source is not None
    assert (source.phase, source.name, source.module, source.op) == EXPECTED[where]
    assert source.shape == (6, 8)
    assert source.dtype == torch.float32
    assert source.micro_batch == 0


def test_find_nonfinite_names_a_bad_input_and_the_functions_own_code() -> None:
    model = _net()
    x, y = _batch()
    bad = x.clone()
    bad[2, 1] = NAN
    src = find_nonfinite(lambda a, *, target: F.mse_loss(model(a), target), bad, target=y)
    assert src == NonFiniteSource("input", "args[0]", None, (6, 4), torch.float32)
    src = find_nonfinite(lambda a, *, target: F.mse_loss(model(a), target), x, target=y * NAN)
    assert src is not None
    assert (src.phase, src.name) == ("input", "kwargs['target']")
    src = find_nonfinite(lambda a: (model(a) - 100).log().mean(), x)  # log(<0): NaN
    assert src is not None
    assert (src.phase, src.module) == ("forward", None)
    assert "outside any module" in str(src)


def test_find_nonfinite_returns_none_when_all_is_finite() -> None:
    model = _net()
    x, y = _batch()
    before = _everything(model, None)
    assert find_nonfinite(lambda a: F.mse_loss(model(a), y), x) is None
    _assert_same(before, _everything(model, None))


def test_find_nonfinite_names_modules_inside_a_ddp_like_wrapper() -> None:
    class Wrapper(nn.Module):  # named as DDP is, so it is unwrapped for naming
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)  # type: ignore[no-any-return]

    Wrapper.__name__ = "DistributedDataParallel"
    model = _net()
    model.block.act.bad = True
    wrapped = Wrapper(model)
    src = find_nonfinite(lambda a: wrapped(a).sum(), _batch()[0])
    assert src is not None
    assert src.name == "block.act"


def test_find_nonfinite_refuses_what_it_cannot_call() -> None:
    with pytest.raises(TypeError, match=r"find_nonfinite\(fn=...\) expects the loss function"):
        find_nonfinite(torch.ones(2))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- inside autocast_step


def _step(model: Net, accumulate: int = 1, **kwargs: Any) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return autocast_step(
        opt, model=model, dtype=torch.float32, accumulate=accumulate, locate_nonfinite=True,
        **kwargs,
    )  # fmt: skip


def _located(result: Any) -> Any:
    """``result.nonfinite``, read (on the device path that reads the verdict and replays)."""
    bool(result.nonfinite)
    return result.nonfinite


def _run_poisoned(where: str, locate: bool, device_path: bool) -> tuple[Any, dict[str, Any]]:
    """Two windows (the second poisoned) from the same RNG; the result and what is owned."""
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = autocast_step(opt, model=model, dtype=torch.float32, locate_nonfinite=locate)
    train = step(lambda a, b: F.mse_loss(model(a), b))
    x, y = _batch()
    train(x, y)
    handle = _poison(model, where)
    result = train(x, y)
    if device_path and locate:
        assert result.nonfinite  # located when read: here, before the next window
    assert step.skipped_steps == 1
    _cure(model, handle)
    return result, _everything(model, opt)


@pytest.mark.parametrize("where", list(EXPECTED))
def test_a_skipped_window_is_replayed_and_named(where: str, skip_on: str) -> None:
    """Named correctly, and everything equals the same run without locate_nonfinite."""
    plain, want = _run_poisoned(where, locate=False, device_path=skip_on == "device")
    with pytest.warns(NonFiniteWarning, match=f"the first came from .*{where.split()[0]}"):
        result, got = _run_poisoned(where, locate=True, device_path=skip_on == "device")
    got["grad_ids"] = want["grad_ids"]  # (two models: their own .grad objects)
    _assert_same(want, got)
    assert plain.nonfinite is None
    src = result.nonfinite
    assert (src.phase, src.name, src.module, src.op) == EXPECTED[where]


def test_the_device_path_locates_when_the_verdict_is_read(skip_on_device: None) -> None:
    model = _net()
    step = _step(model)
    train = step(lambda a, b: F.mse_loss(model(a), b))
    x, y = _batch()
    model.block.act.bad = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = train(x, y)  # the verdict stays on the device: nothing located yet
    with pytest.warns(NonFiniteWarning, match="'block.act'") as caught:
        train(x, y)  # reads the previous verdict: replays that window's micro-batch
    assert len(caught) == 1  # (this window's verdict is read later)
    assert result.nonfinite.name == "block.act"  # located before, by the step


def test_the_micro_batch_of_the_window_is_named(skip_on: str) -> None:
    model = _net()
    step = _step(model, accumulate=3)
    train = step(lambda a, b: F.mse_loss(model(a), b))
    x, y = _batch()
    bad = x.clone()
    bad[0, 0] = NAN
    train(x, y)
    train(bad, y)
    with pytest.warns(NonFiniteWarning, match=r"input args\[0\]"):
        source = _located(train(x, y))
    assert source.micro_batch == 1
    assert source.phase == "input"


def test_nothing_is_replayed_or_kept_when_all_is_finite(
    skip_on: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replays: list[Any] = []
    monkeypatch.setattr(amp_watch, "replay", lambda *a, **k: replays.append(a))
    model = _net()
    step = _step(model, accumulate=2)
    train = step(lambda a, b: F.mse_loss(model(a), b))
    x, y = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = [train(x, y) for _ in range(6)]
    assert step.steps == 3
    assert not replays
    assert not any(r.nonfinite for r in results)
    assert step._stepper.watch._calls == []  # the micro-batches were let go
    off = autocast_step(torch.optim.SGD(model.parameters(), lr=0.1))
    fn = lambda a: model(a).sum()  # noqa: E731
    assert off(fn).__wrapped__ is fn  # no recording layer at all


def test_the_explicit_form_cannot_replay_and_says_so(skip_on: str) -> None:
    model = _net()
    step = _step(model)
    x, y = _batch()
    with step:
        loss = F.mse_loss(model(x), y) * NAN
    with pytest.warns(NonFiniteWarning, match="cannot replay it.*find_nonfinite"):
        source = _located(step.backward(loss))
    assert not source


def test_a_replay_that_raises_is_reported_not_raised() -> None:
    model = _net()
    step = _step(model)
    calls = [0]

    @step
    def train(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("data loader gone")
        return F.mse_loss(model(a), b) * NAN

    with pytest.warns(NonFiniteWarning, match="replaying it raised RuntimeError: data loader"):
        result = train(*_batch())
    assert result.skipped
    assert result.nonfinite is None


def test_locate_refuses_an_fsdp2_model() -> None:
    class FakeFsdp(Net):
        def set_requires_gradient_sync(self, flag: bool) -> None:
            pass

    model = FakeFsdp()
    step = _step(model)
    with pytest.raises(ValueError, match="cannot replay an FSDP2 model"):
        step(lambda a: model(a).sum())
