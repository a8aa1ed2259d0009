"""cudakit: fast, correct PyTorch training on NVIDIA GPUs without rewriting the loop.

Composable utilities, each a plain call, a decorator or a ``with`` block:
:func:`on_device`, :func:`autocast_step`, :func:`warmup`, :func:`memory_report`,
:func:`speed_report`, :func:`parallelize`, :func:`prefetch` and :class:`Checkpointer`,
plus device detection (:func:`device_info`) and DataLoader settings (:func:`loader_kwargs`).

Less common names live in their modules: ``cudakit.device``, ``cudakit.amp``,
``cudakit.memory``, ``cudakit.warmup``, ``cudakit.parallel``, ``cudakit.data``,
``cudakit.checkpoint``, ``cudakit.speed``.
"""

from ._deprecated import renamed as _renamed
from ._version import __version__
from .amp import AutocastStep, StepResult, autocast_step
from .checkpoint import Checkpointer, Position, find_latest
from .data import loader_kwargs, prefetch
from .device import DeviceLike, on_device, register_container, resolve_device
from .exceptions import (
    BatchSizeSearchError,
    CheckpointError,
    CheckpointSaveError,
    CompiledWarmupWarning,
    CudakitError,
    DeviceError,
    DistributedSetupError,
    LaunchError,
    MemoryReserveError,
    NonFiniteStepsError,
    ReserveIgnoredWarning,
    TensorsLeftBehindWarning,
)
from .info import CudaDeviceInfo, DeviceInfo, device_info
from .memory import MemoryReport, MemorySnapshot, memory_report, memory_snapshot
from .parallel import (
    choose_strategy,
    distributed_loader,
    is_main_process,
    launch,
    local_rank,
    main_process_first,
    parallelize,
    process_group,
    rank,
    unwrap,
    world_size,
)
from .speed import SpeedMeter, speed_report
from .warmup import WarmupReport, find_batch_size, preserve_state, warmed, warmup

__all__ = [
    "AutocastStep",
    "BatchSizeSearchError",
    "CheckpointError",
    "CheckpointSaveError",
    "Checkpointer",
    "CompiledWarmupWarning",
    "CudaDeviceInfo",
    "CudakitError",
    "DeviceError",
    "DeviceInfo",
    "DeviceLike",
    "DistributedSetupError",
    "LaunchError",
    "MemoryReport",
    "MemoryReserveError",
    "MemorySnapshot",
    "NonFiniteStepsError",
    "Position",
    "ReserveIgnoredWarning",
    "SpeedMeter",
    "StepResult",
    "TensorsLeftBehindWarning",
    "WarmupReport",
    "__version__",
    "autocast_step",
    "choose_strategy",
    "device_info",
    "distributed_loader",
    "find_batch_size",
    "find_latest",
    "is_main_process",
    "launch",
    "loader_kwargs",
    "local_rank",
    "main_process_first",
    "memory_report",
    "memory_snapshot",
    "on_device",
    "parallelize",
    "prefetch",
    "preserve_state",
    "process_group",
    "rank",
    "register_container",
    "resolve_device",
    "speed_report",
    "unwrap",
    "warmed",
    "warmup",
    "world_size",
]

__getattr__ = _renamed(__name__, {"SpeedReport": SpeedMeter})
