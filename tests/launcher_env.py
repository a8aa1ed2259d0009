"""What the distributed tests share: a free port, torchrun's variables, spawned ranks."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cudakit.parallel import group as cp_group

LAUNCHER_VARS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def free_port() -> int:
    """A TCP port nothing listens on right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    worker: Callable[..., None], out: Path, world: int, timeout: float = 180
) -> list[Any]:
    """Spawn ``worker(rank, port, str(out))`` on ``world`` gloo ranks; load each ``{rank}.pt``.

    Fails the test (killing the ranks) when they have not finished within ``timeout``.
    """
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        worker, args=(free_port(), str(out)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world}-process gloo run did not finish within {timeout:g} s")
    assert not any(p.is_alive() for p in ctx.processes)
    return [torch.load(out / f"{r}.pt", weights_only=True) for r in range(world)]


def torchrun_env(world: int, rank: int = 0, port: int = 29500) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of ``world`` on this machine."""
    return {
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def join_gloo(rank: int, port: int, world: int, timeout: float = 60) -> None:
    """Inside a spawned rank: torchrun's variables (``LOCAL_WORLD_SIZE`` too), then the
    gloo process group, with a finite timeout."""
    import datetime

    os.environ.update(torchrun_env(world, rank, port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )


@pytest.fixture(autouse=True)
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No launcher variables from outside; no process group left behind (import it)."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    # A test run inside a SLURM job must not look like a task srun launched.
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name, raising=False)
    yield
    cp_group.teardown_owned_group()
    assert not dist.is_initialized()
