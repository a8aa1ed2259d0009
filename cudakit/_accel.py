"""The current accelerator device and what the hardware runs natively (one home for both).

Nothing here starts CUDA.
"""

from __future__ import annotations

import torch

__all__ = [
    "cpu_native_bf16",
    "cpu_native_fp16",
    "current_cuda_index",
    "default_cuda_index",
    "follows_current_device",
    "host_read_waits",
    "synchronize",
]


def current_cuda_index() -> int:
    """Index of the current CUDA device; 0 before CUDA starts (never creates a context)."""
    # Before CUDA starts, the current device is 0 unless the user changed it
    # (which starts CUDA).
    if torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return 0


def default_cuda_index() -> int:
    """The CUDA device this process means by ``"cuda"`` or ``"auto"`` (never starts CUDA).

    Once CUDA runs, the current device. Before, torch's current device is 0 in every
    process, so under a launcher it is the launcher's ``LOCAL_RANK`` (torchrun; SLURM's
    ``SLURM_LOCALID`` under srun) when this machine shows that device, else 0: a rank
    that resolves its device before ``torch.cuda.set_device`` (or ``parallelize()``)
    gets its own GPU, not GPU 0.
    """
    if torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    import os

    from ._dist import launcher_view

    raw = launcher_view(os.environ).get("LOCAL_RANK", "")
    if raw.isdigit() and int(raw) < torch.cuda.device_count():
        return int(raw)
    return 0


def follows_current_device(device: object) -> bool:
    """Whether ``device=`` means "this thread's current CUDA device" rather than a fixed one.

    ``None``, ``"auto"``, ``"cuda"`` and ``torch.device("cuda")`` follow
    ``torch.cuda.set_device``; ``"cuda:1"``, ``"cpu"`` and the like do not.
    """
    if isinstance(device, torch.device):
        return device.type == "cuda" and device.index is None
    return device is None or (isinstance(device, str) and device in ("auto", "cuda"))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op for devices that run synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_read_waits(device_type: str) -> bool:
    """Whether reading a value of a ``device_type`` tensor on the host waits for queued work.

    True for accelerators (CUDA, XPU, MPS...), whose kernels run asynchronously to the
    host; False for the CPU, where every op has finished when it returns.
    """
    return device_type != "cpu"


def cpu_native_bf16() -> bool:
    """True when this CPU computes bf16 natively (oneDNN's AVX512-bf16/AMX check)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def cpu_native_fp16() -> bool:
    """True when this CPU computes fp16 natively (oneDNN's AVX512-fp16/AMX-fp16 check)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False
