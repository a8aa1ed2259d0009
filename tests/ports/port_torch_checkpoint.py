"""Models and the two-rank body shared by the ported torch checkpoint tests.

The models follow test/distributed/_composable/test_checkpoint.py: a block that draws
random numbers in its forward, one that returns a tuple and one that takes it. The
body runs on every gloo rank (``cp.launch``), so it lives in a module the ranks import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import cudakit.parallel as cp

WIDTH = 12


class RandomBlock(nn.Module):
    """Draws a fresh matrix in every forward: recompute must draw the same one again."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(WIDTH, WIDTH, device=self.p.device)
        return x + torch.tanh(x @ (self.p @ noise))


class MultiOutput(nn.Module):
    """Returns two tensors: the backward gets two incoming gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)
        self.w2 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.relu(x @ self.w1) @ self.w2
        return z.sin(), z.cos()


class MultiInput(nn.Module):
    """Takes the tuple MultiOutput returns."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = xs
        return torch.relu((x + y) @ self.w)


class Chain(nn.Module):
    """A stack of the blocks above in one ``nn.ModuleList``, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [RandomBlock(), MultiOutput(), MultiInput(), MultiOutput(), MultiInput()]
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: Any) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def chain(seed: int = 0) -> Chain:
    torch.manual_seed(seed)
    return Chain()


def fsdp_steps(policies: list[str | None]) -> dict[str, Any]:
    """On every rank: two SGD steps of a sharded Chain per policy; the full state on rank 0.

    Each rank feeds its own batch and its own random stream, so FSDP2's reduce-scatter
    and the replayed RNG both matter.
    """
    out: dict[str, Any] = {}
    with cp.process_group(timeout=120):
        for policy in policies:
            model = cp.parallelize(chain(), "fsdp", device="cpu", recompute=policy)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(100 + cp.rank())
            losses = []
            for _ in range(2):
                x = torch.randn(6, WIDTH, generator=g)
                torch.manual_seed(7 + cp.rank())  # the noise RandomBlock draws
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach().clone())
            out[str(policy)] = {
                "state": {k: v.detach().clone() for k, v in cp.state_dict(model).items()},
                "keys": list(cp.unwrap(model).state_dict()),
                "losses": losses,
                "recomputed": cp.recomputed_blocks(cp.unwrap(model)),
            }
    return out
