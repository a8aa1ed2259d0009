"""Every read of the device the meter makes, in one place (tests replace these functions)."""

from __future__ import annotations

import torch

__all__ = ["device_name", "tf32_matmuls"]


def device_name(device: torch.device) -> str | None:
    """The driver's name of a CUDA device; None for other devices or before CUDA starts.

    Never starts CUDA: a meter that has measured CUDA steps finds it started.
    """
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    return str(torch.cuda.get_device_name(device))


def tf32_matmuls() -> bool:
    """Whether float32 matmuls run on TF32 Tensor Cores (``torch.set_float32_matmul_precision``)."""
    return torch.get_float32_matmul_precision() != "highest" or bool(
        torch.backends.cuda.matmul.allow_tf32
    )
