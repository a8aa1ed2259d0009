"""A small GPT for the meta-device tests: tied embeddings, RoPE, a scaled residual init.

Imported by the tests and by the ranks they launch; widths are arguments, so
hypothesis can pick ones that do not divide by the world size.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Rotary(nn.Module):
    """RoPE's inverse frequencies: a non-persistent buffer, recomputed by reset_parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self._freqs(None), persistent=False)

    def _freqs(self, device: torch.device | None) -> torch.Tensor:
        steps = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device)
        return 1.0 / (10000.0 ** (steps / self.dim))

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(self._freqs(self.inv_freq.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        angles = torch.outer(t, self.inv_freq)
        return x * torch.cos(angles).repeat(1, 2)[: x.shape[1], : x.shape[2]]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 37, width: int = 10, depth: int = 2) -> None:
        super().__init__()
        self.depth = depth
        self.embed = nn.Embedding(vocab, width)
        self.rope = Rotary(width)
        self.layers = nn.ModuleList([Block(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.rope(self.embed(idx))
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def gpt_init(module: nn.Module, name: str) -> None:
    """GPT-2's init: N(0, 0.02), the residual projections scaled by 1/sqrt(2 * depth)."""
    if isinstance(module, nn.Linear):
        std = 0.02 / math.sqrt(2 * 2) if name.endswith(".proj") else 0.02
        nn.init.normal_(module.weight, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
