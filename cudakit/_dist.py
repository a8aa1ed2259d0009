"""The one place that reads the distributed environment of this process.

``launched_world_size`` reads what a launcher (torchrun, ``cudakit.launch``, SLURM)
promised through the environment; ``group_world_size`` and ``group_rank`` read the
process group actually running. Both answer without starting anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["group_rank", "group_world_size", "is_group_running", "launched_world_size"]


def is_group_running() -> bool:
    """True when ``torch.distributed`` is built in and a default process group exists."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def group_world_size(group: object = None) -> int:
    """Processes in ``group`` (the default group) of the running process group; 1 without one."""
    if not is_group_running():
        return 1
    return int(torch.distributed.get_world_size(group))  # type: ignore[arg-type]


def group_rank() -> int:
    """This process's rank in the running default group; 0 without one."""
    if not is_group_running():
        return 0
    return int(torch.distributed.get_rank())


def launched_world_size(env: Mapping[str, str] | None = None) -> int:
    """``WORLD_SIZE`` as a launcher set it (1 when unset or unreadable)."""
    value = (os.environ if env is None else env).get("WORLD_SIZE", "1")
    try:
        return max(1, int(value))
    except ValueError:
        return 1
