"""Device detection: everything ``torch.cuda`` can tell about this machine, in one report."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ._accel import cpu_native_bf16, cpu_native_fp16
from ._check import check_bool, check_int, check_optional
from ._units import format_bytes
from .device import resolve_device

__all__ = ["CudaDeviceInfo", "DeviceInfo", "device_info"]


@dataclass(frozen=True)
class CudaDeviceInfo:
    """What torch reports about one CUDA device (memory figures in bytes)."""

    index: int
    name: str
    capability: tuple[int, int]
    total_memory: int
    multiprocessors: int
    #: Native bfloat16 (compute capability 8.0 or newer), not torch's emulation.
    bf16_native: bool
    #: ``None`` where reading it would have started CUDA.
    free_memory: int | None
    allocated: int
    reserved: int
    peak_allocated: int


@dataclass(frozen=True)
class DeviceInfo:
    """One report of the torch/CUDA stack; returned by :func:`device_info`."""

    torch_version: str
    cuda_version: str | None
    cudnn_version: int | None
    cuda_available: bool
    cuda_initialized: bool
    device_count: int
    current_device: int | None
    mps_available: bool
    #: The device ``resolve_device("auto")`` picks, i.e. where training would run.
    training_device: str
    devices: tuple[CudaDeviceInfo, ...] = field(default_factory=tuple)
    #: Set when per-device details were left out, saying why.
    note: str | None = None
    #: This CPU computes bf16 natively (AVX512-bf16/AMX); else bf16 is emulated and slow.
    cpu_bf16_native: bool = False
    #: This CPU computes fp16 natively (AVX512-fp16/AMX-fp16).
    cpu_fp16_native: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON.

        Args:
            indent: spaces per level, or None for one line.

        Raises:
            TypeError: ``indent`` is not an int or None.
            ValueError: ``indent`` is negative.
        """
        indent = check_optional(check_int, "DeviceInfo.to_json", "indent", indent, minimum=0)
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        lines = [
            f"torch           {self.torch_version}",
            f"CUDA (build)    {self.cuda_version or 'none (CPU-only build of torch)'}",
            f"cuDNN           {self.cudnn_version if self.cudnn_version is not None else 'n/a'}",
            f"CUDA available  {self.cuda_available}",
            f"device count    {self.device_count}",
            f"current device  {'n/a' if self.current_device is None else self.current_device}",
            f"MPS available   {self.mps_available}",
            f"training device {self.training_device}",
            f"CPU native bf16 {'yes' if self.cpu_bf16_native else 'no'}, "
            f"native fp16 {'yes' if self.cpu_fp16_native else 'no'}"
            + (
                ""
                if self.cpu_bf16_native
                else " (autocast_step(dtype='auto') trains in float32 on this CPU)"
            ),
        ]
        if not self.cuda_available:
            lines.append(
                f"No CUDA GPU is available here; training will run on {self.training_device}."
            )
        for d in self.devices:
            lines += [
                f"cuda:{d.index}  {d.name}",
                f"  compute capability {d.capability[0]}.{d.capability[1]}, "
                f"{d.multiprocessors} SMs, bf16 native: {'yes' if d.bf16_native else 'no'}",
                f"  memory total {format_bytes(d.total_memory)}, "
                f"free {format_bytes(d.free_memory)}",
                f"  allocated {format_bytes(d.allocated)}, reserved {format_bytes(d.reserved)}, "
                f"peak allocated {format_bytes(d.peak_allocated)}",
            ]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _cudnn_version() -> int | None:
    try:
        v = torch.backends.cudnn.version()
    except Exception:  # a broken cuDNN install must not break a report
        return None
    return int(v) if v is not None else None


def device_info(*, init_cuda: bool = False) -> DeviceInfo:
    """Collect torch's device-detection facts into one typed, printable report.

    Reading per-device properties starts CUDA in this process. A report must not
    do that behind your back, so unless CUDA has already started (or you pass
    ``init_cuda=True``, as ``cudakit info`` does) the per-device details are left
    out and :attr:`DeviceInfo.note` says so.

    >>> info = device_info()
    >>> info.torch_version == torch.__version__
    True
    >>> isinstance(info.to_json(), str)
    True

    Args:
        init_cuda: allow starting CUDA to read per-device properties and free memory.

    Returns:
        A frozen ``DeviceInfo``; ``str()`` gives the text ``cudakit info`` prints.

    Raises:
        TypeError: ``init_cuda`` is not a bool (``"no"`` would be truthy).

    .. versionadded:: 0.1
    """
    check_bool("device_info", "init_cuda", init_cuda)
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    initialized = bool(available and torch.cuda.is_initialized())
    mps = getattr(torch.backends, "mps", None)
    devices: list[CudaDeviceInfo] = []
    note = None
    if available and not initialized and not init_cuda:
        note = (
            "CUDA has not started in this process; per-device details were left out so as not "
            "to create a CUDA context. Pass init_cuda=True (or run `cudakit info`) to read them."
        )
    elif available:
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            free, _total = torch.cuda.mem_get_info(i)
            devices.append(
                CudaDeviceInfo(
                    index=i,
                    name=str(props.name),
                    capability=(int(props.major), int(props.minor)),
                    total_memory=int(props.total_memory),
                    multiprocessors=int(props.multi_processor_count),
                    bf16_native=int(props.major) >= 8,
                    free_memory=int(free),
                    allocated=int(torch.cuda.memory_allocated(i)),
                    reserved=int(torch.cuda.memory_reserved(i)),
                    peak_allocated=int(torch.cuda.max_memory_allocated(i)),
                )
            )
        initialized = bool(torch.cuda.is_initialized())
    current = int(torch.cuda.current_device()) if initialized else (0 if available else None)
    return DeviceInfo(
        torch_version=str(torch.__version__),
        cuda_version=torch.version.cuda,
        cudnn_version=_cudnn_version() if available else None,
        cuda_available=available,
        cuda_initialized=initialized,
        device_count=count,
        current_device=current,
        mps_available=bool(mps is not None and mps.is_available()),
        training_device=str(resolve_device("auto")),
        devices=tuple(devices),
        note=note,
        cpu_bf16_native=cpu_native_bf16(),
        cpu_fp16_native=cpu_native_fp16(),
    )
