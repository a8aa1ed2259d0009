"""A small model the parallel tests wrap, and a check that a refused call left its
state as it was."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Net", "snapshot", "unchanged"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def snapshot(model: nn.Module) -> list[tuple[str, torch.device, torch.Tensor]]:
    return [(k, v.device, v.detach().clone()) for k, v in model.state_dict().items()]


def unchanged(model: nn.Module, before: list[tuple[str, torch.device, torch.Tensor]]) -> bool:
    after = snapshot(model)
    return len(after) == len(before) and all(
        k1 == k2 and d1 == d2 and torch.equal(t1, t2)
        for (k1, d1, t1), (k2, d2, t2) in zip(before, after, strict=True)
    )
