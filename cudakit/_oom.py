"""Recognising out-of-memory errors, shared by ``warmup`` and ``memory``."""

from __future__ import annotations

import torch

from ._check import check_type

__all__ = ["is_oom_error"]


_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "HIP out of memory",
    "XPU out of memory",
    "MPS backend out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    # cuDNN reports a workspace it cannot get for a huge batch as "not supported".
    "CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_oom_error(exc: BaseException) -> bool:
    """Tell whether an exception means "out of memory" (so a smaller batch may fit).

    True for ``torch.OutOfMemoryError``, Python's ``MemoryError``, and the
    ``RuntimeError``\\ s torch raises for CUDA/HIP/XPU/MPS allocation failures, cuBLAS,
    cuSOLVER, cuFFT and cuDNN allocation failures, and the CPU allocator running out.

    >>> import torch
    >>> from cudakit._oom import is_oom_error
    >>> is_oom_error(
    ...     torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ... )
    True
    >>> is_oom_error(
    ...     RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ...")
    ... )
    True
    >>> is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    False

    Args:
        exc: Any exception.

    Returns:
        ``True`` if it reports an allocation failure.

    Raises:
        TypeError: ``exc`` is not an exception.

    .. versionadded:: 0.1
    """
    check_type(
        "is_oom_error",
        "exc",
        exc,
        BaseException,
        expected="an exception",
        fix="Pass the exception you caught: `except Exception as exc: if is_oom_error(exc): ...`.",
    )
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(marker in text for marker in _OOM_MESSAGES)
    return False
