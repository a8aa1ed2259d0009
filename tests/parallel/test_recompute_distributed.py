"""recompute= under DDP and FSDP2 over gloo: the same weights after a step as without it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudakit.parallel as cp

pytestmark = pytest.mark.distributed

POLICIES = (None, "full", "selective")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.tanh(self.up(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _train(strategy: str, policy: str | None) -> tuple[dict[str, torch.Tensor], list[str]]:
    torch.manual_seed(0)
    model = cp.parallelize(_Net(), strategy, device="cpu", recompute=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + cp.rank())
    for _ in range(2):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        torch.manual_seed(5 + cp.rank())  # dropout's RNG, replayed by recompute
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    keys = list(cp.unwrap(model).state_dict())
    state = {k: v.detach().clone() for k, v in cp.state_dict(model).items()}
    return state, keys


def _body() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        for policy in POLICIES:
            state, keys = _train(strategy, policy)
            out[f"{strategy}-{policy}"] = state
            out[f"{strategy}-{policy}-keys"] = keys
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return cp.launch(_body, nprocs=2, timeout=240)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_same_weights_bit_for_bit(
    results: list[dict[str, Any]], strategy: str, policy: str
) -> None:
    want, got = results[0][f"{strategy}-None"], results[0][f"{strategy}-{policy}"]
    assert want.keys() == got.keys()
    assert want  # rank 0 holds the full state dict
    for key in want:
        assert torch.equal(want[key], got[key]), key


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_keys_unchanged(results: list[dict[str, Any]], strategy: str) -> None:
    for rank in results:
        base = rank[f"{strategy}-None-keys"]
        assert rank[f"{strategy}-full-keys"] == base
        assert rank[f"{strategy}-selective-keys"] == base
