"""The current accelerator device, read without starting CUDA (one home for it)."""

from __future__ import annotations

import torch

__all__ = ["current_cuda_index"]


def current_cuda_index() -> int:
    """Index of the current CUDA device; 0 before CUDA starts (never creates a context)."""
    # Before CUDA starts, the current device is 0 unless the user changed it
    # (which starts CUDA).
    if torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return 0
