"""The demo's data: a deterministic, learnable CIFAR-10-shaped data set made in memory."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._check import check_int, fail_value

__all__ = ["NUM_CLASSES", "make_dataset"]

NUM_CLASSES = 10


def make_dataset(
    n: int, *, seed: int = 0, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate a deterministic, learnable CIFAR-10-shaped data set.

    Each of the 10 classes is a smooth random colour pattern (fixed by ``seed``);
    an image is its class pattern shifted by up to 4 pixels, with random contrast,
    brightness and Gaussian noise. ``split`` picks an independent stream of images
    over the same patterns, so a ``"val"`` split measures generalisation.

    >>> images, labels = make_dataset(8, seed=1)
    >>> images.shape, images.dtype, labels.tolist()
    (torch.Size([8, 3, 32, 32]), torch.float32, [6, 1, 7, 5, 7, 5, 7, 0])
    >>> torch.equal(make_dataset(8, seed=1)[0], images)
    True

    Args:
        n: number of images.
        seed: fixes the class patterns and the images.
        split: ``"train"`` or ``"val"``; the two never share an image.

    Returns:
        ``(images, labels)``: a float32 tensor ``(n, 3, 32, 32)`` and an int64 tensor ``(n,)``.

    Raises:
        ValueError: ``n`` below 1, ``split`` unknown, or ``seed`` beyond +-2**62.
        TypeError: ``n`` or ``seed`` is not an int (NumPy's are ints; ``True`` is not).

    .. versionadded:: 0.1
    """
    n = check_int(
        "make_dataset", "n", n, minimum=1, fix="It counts the images: pass e.g. n=64."
    )  # a NumPy int too
    seed = check_int("make_dataset", "seed", seed, minimum=-(2**62), maximum=2**62)
    if split not in ("train", "val"):  # a ValueError for any kind, as documented
        fail_value(
            "make_dataset", "split", "'train' or 'val'", split, "Pass split='train' or split='val'."
        )
    patterns_gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(NUM_CLASSES, 3, 4, 4, generator=patterns_gen)
    patterns = nn.functional.interpolate(coarse, size=(40, 40), mode="bicubic", align_corners=False)
    patterns = (patterns - patterns.mean(dim=(1, 2, 3), keepdim=True)) / patterns.std(
        dim=(1, 2, 3), keepdim=True
    )
    gen = torch.Generator().manual_seed(seed * 2 + (1 if split == "val" else 0) + 1_000_003)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=gen)
    dy, dx = torch.randint(0, 9, (2, n), generator=gen).tolist()
    crops = _crop(patterns, labels, dy, dx)
    contrast = torch.empty(n, 1, 1, 1).uniform_(0.5, 1.5, generator=gen)
    brightness = torch.randn(n, 3, 1, 1, generator=gen) * 0.3
    noise = torch.randn(n, 3, 32, 32, generator=gen) * 2.5
    # A weaker pattern of another class on top makes the classes overlap.
    other = (labels + torch.randint(1, NUM_CLASSES, (n,), generator=gen)) % NUM_CLASSES
    distractor = _crop(patterns, other, dx, dy)
    images = crops * contrast + 0.6 * distractor + brightness + noise
    return images.contiguous(), labels


def _crop(patterns: torch.Tensor, classes: torch.Tensor, dy: list[int], dx: list[int]) -> Tensor:
    """A 32x32 window of each image's class pattern at offset (dy, dx)."""
    windows = zip(classes.tolist(), dy, dx, strict=True)
    return torch.stack([patterns[c, :, y : y + 32, x : x + 32] for c, y, x in windows])
