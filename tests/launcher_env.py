"""What the distributed tests share: a free port and torchrun's environment variables."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
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


def torchrun_env(world: int, rank: int = 0, port: int = 29500) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of ``world`` on this machine."""
    return {
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


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
