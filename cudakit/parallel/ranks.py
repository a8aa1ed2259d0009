"""Who am I: rank helpers, a barrier, and ``main_process_first``.

The numbers come from :mod:`cudakit._dist`, the one place that reads the
distributed environment.
"""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import Self

import torch
import torch.distributed as dist

from .._check import check_bool
from .._contextlib import ContextDecorator
from .._dist import (
    current_rank,
    current_world_size,
    group_world_size,
    is_group_running,
    launched_local_rank,
)
from .._stacklevel import user_stacklevel

__all__ = [
    "barrier",
    "is_main_process",
    "local_rank",
    "main_process_first",
    "rank",
    "world_size",
]


def rank() -> int:
    """This process's global rank: from the process group, else ``RANK``, else 0.

    >>> import cudakit.parallel as cp
    >>> cp.rank()
    0

    .. versionadded:: 0.1
    """
    return current_rank()


def world_size() -> int:
    """The number of processes: from the process group, else ``WORLD_SIZE``, else 1.

    >>> import cudakit.parallel as cp
    >>> cp.world_size()
    1

    .. versionadded:: 0.1
    """
    return current_world_size()


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, else 0): its GPU index under torchrun.

    >>> import cudakit.parallel as cp
    >>> cp.local_rank()
    0

    .. versionadded:: 0.1
    """
    return launched_local_rank()


def is_main_process(*, local: bool = False) -> bool:
    """Whether this is rank 0 (``local=True``: local rank 0, one per node).

    >>> import cudakit.parallel as cp
    >>> cp.is_main_process()
    True

    Args:
        local: ask about the node (for per-node work such as a download to local disk).

    .. versionadded:: 0.1
    """
    check_bool("is_main_process", "local", local)
    return (local_rank() if local else rank()) == 0


def barrier() -> None:
    """Wait for every rank of the running default group (on this rank's GPU under NCCL)."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


class main_process_first(ContextDecorator):
    """Run the block on the main process first, then on every other rank.

    >>> import cudakit.parallel as cp
    >>> with cp.main_process_first():  # one process: just runs the block
    ...     data = [1, 2, 3]  # e.g. download, then everyone reads the cache

    The other ranks wait in a barrier until the main process has finished the
    block (also when it raised: they are released rather than left hanging until
    the timeout). Without an initialised process group of more than one process it
    simply runs the block; under a launcher with several ranks but no group yet it
    warns that the ranks are not ordered (enter :func:`process_group` first). Works
    as ``@main_process_first()`` too.

    Args:
        local: main process per node (local rank 0) instead of global rank 0; use it
            when each node has its own disk.

    .. versionadded:: 0.1
    """

    def __init__(self, *, local: bool = False) -> None:
        check_bool(
            "main_process_first",
            "local",
            local,
            fix="Pass local=True for one main process per node, local=False for rank 0.",
        )
        self.local = local
        self._sync = False

    def clone(self) -> Self:
        return type(self)(local=self.local)

    def __enter__(self) -> None:
        running = is_group_running()
        if not running and current_world_size() > 1:
            warnings.warn(
                "main_process_first(): this process is one of "
                f"{current_world_size()} launched ranks, but no process group is running "
                "yet, so the ranks run the block at the same time. Enter "
                "cudakit.parallel.process_group(timeout=...) (or call parallelize()) first; "
                "give it a timeout longer than the block takes.",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        self._sync = running and group_world_size() > 1
        if self._sync and not is_main_process(local=self.local):
            barrier()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sync and is_main_process(local=self.local):
            barrier()
