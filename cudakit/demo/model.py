"""The demo's model: a small conv-bn-relu network."""

from __future__ import annotations

import torch  # noqa: F401 (the doctest uses it)
from torch import nn

from .._check import check_int
from .data import NUM_CLASSES

__all__ = ["make_model"]


def make_model(width: int = 16) -> nn.Sequential:
    """Build the demo's CNN: four conv-bn-relu blocks, global pooling and a linear head.

    >>> model = make_model(width=8)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])

    Args:
        width: channels of the first block; the others use 2x and 4x that.

    Returns:
        An ``nn.Sequential`` mapping ``(N, 3, 32, 32)`` images to ``(N, 10)`` logits.

    Raises:
        TypeError: ``width`` is not an int (NumPy's are).
        ValueError: ``width`` is below 1.

    .. versionadded:: 0.1
    """
    width = check_int("make_model", "width", width, minimum=1, fix="Pass e.g. width=16.")

    def block(c_in: int, c_out: int, pool: bool) -> list[nn.Module]:
        layers: list[nn.Module] = [
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
        ]
        return [*layers, nn.MaxPool2d(2)] if pool else layers

    w = width
    return nn.Sequential(
        *block(3, w, pool=False),
        *block(w, 2 * w, pool=True),  # 16x16
        *block(2 * w, 4 * w, pool=True),  # 8x8
        *block(4 * w, 4 * w, pool=True),  # 4x4
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * w, NUM_CLASSES),
    )
