"""Naming the producer in the shapes real models take: activation checkpointing, keyword
inputs (attention masks), users' forward hooks, a step that calls submodules itself,
a batch changed in place, and an fp16 loss scale that overflows."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cudakit.amp import NonFiniteWarning, autocast_step, find_nonfinite


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 100.0)  # NaN everywhere for small inputs


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, bad: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(4, 8)
        self.inner = nn.Sequential(nn.Linear(8, 8), Log() if bad else nn.Tanh())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.inner, self.inp(x), use_reentrant=self.reentrant)
        return self.head(h)  # type: ignore[no-any-return]


def _grads(model: nn.Module) -> list[Any]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("bad", [False, True])
def test_activation_checkpointing_replays(reentrant: bool, bad: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant, bad)
    weights = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 4, requires_grad=reentrant)  # reentrant needs an input with grad
    src = find_nonfinite(lambda a: model(a).sum(), x)
    if bad:
        assert src is not None
        assert (src.phase, src.name, src.module) == ("forward", "inner.1", "Log")
    else:
        assert src is None
    assert all(p.grad is None for p in model.parameters())
    assert x.grad is None
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x) + mask, dim=-1)


class Parent(nn.Module):
    def __init__(self, poison: bool) -> None:
        super().__init__()
        self.attn = Attention()
        self.poison = poison

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(x.shape[0], 4)
        mask[:, -1] = float("-inf")  # a legitimate -inf mask
        if self.poison:
            mask = mask + torch.log(torch.tensor(-1.0))  # the parent's own code: NaN
        return self.attn(x, mask=mask)


def test_a_nan_keyword_input_names_the_callers_code_and_an_inf_mask_is_fine() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    assert find_nonfinite(lambda a: Parent(False)(a).sum(), x) is None
    net = Parent(True)
    src = find_nonfinite(lambda a: net(a).sum(), x)
    assert src is not None
    assert (src.phase, src.name, src.module) == ("forward", "", "Parent")


def test_a_forward_hook_that_makes_the_nan_counts_as_its_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    handle = model[0].register_forward_hook(lambda m, i, o: o * float("nan"))
    try:
        src = find_nonfinite(lambda a: model(a).sum(), torch.randn(2, 4))
    finally:
        handle.remove()
    assert src is not None
    assert (src.phase, src.name, src.module) == ("forward", "0", "Linear")
    assert not model[0]._forward_hooks
    assert not model[0]._forward_pre_hooks


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 4), Log())


def test_names_are_qualified_in_the_steps_model(skip_on: str) -> None:
    torch.manual_seed(0)
    net = EncoderDecoder()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    @autocast_step(opt, model=net, dtype=torch.float32, locate_nonfinite=True)
    def step(x: torch.Tensor) -> torch.Tensor:
        return net.decoder(net.encoder(x)).sum()  # the submodules, called by the step

    def run() -> Any:
        result = step(torch.randn(2, 4))
        assert result.nonfinite  # (on the device path: read now, the warning comes then)
        return result

    with pytest.warns(NonFiniteWarning, match=r"forward of 'decoder.1' \(Log\)"):
        result = run()
    assert result.nonfinite.name == "decoder.1"


def test_a_step_that_changes_its_batch_in_place_is_not_changed_again() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @autocast_step(opt, model=model, dtype=torch.float32, locate_nonfinite=True)
    def step(x: torch.Tensor) -> torch.Tensor:
        x.sub_(1.0)
        return torch.log(model(x) - 1e6).sum()

    x = torch.zeros(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        assert step(x).skipped
    assert torch.equal(x, torch.full((2, 4), -1.0))  # the step's own change, once


def test_an_overflow_only_the_loss_scale_made_names_no_module() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # overflows any gradient

    @autocast_step(opt, model=model, dtype=torch.float16, scaler=scaler, locate_nonfinite=True)
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x).float(), y)

    with pytest.warns(NonFiniteWarning, match="only the loss scale made"):
        result = step(torch.randn(8, 4), torch.randn(8, 1))
    assert result.skipped
    assert result.nonfinite is None
    assert scaler.get_scale() < 2.0**100


def test_reentrant_checkpointing_holds_back_an_optimizer_stepped_in_the_backward() -> None:
    """The plain backward the reentrant fallback runs does not fire post-accumulate-grad
    hooks (torch's optimizer-in-backward recipe): no weight moves."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True, bad=False)
    optimizers = {p: torch.optim.SGD([p], lr=1.0) for p in model.parameters()}

    def step_in_backward(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step_in_backward) for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 4, requires_grad=True)
    try:
        assert find_nonfinite(lambda a: model(a).sum(), x) is None
    finally:
        for handle in handles:
            handle.remove()
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
