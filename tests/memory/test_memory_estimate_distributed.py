"""estimate_memory() for DDP and FSDP2 against each rank's real peak, two gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cudakit.parallel as cp
from cudakit.memory import estimate_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_memory_estimate import TOLERANCE, Net, _meta, measure

pytestmark = pytest.mark.distributed

SHAPE = (4, 32, 64)
CELLS = [(s, p) for s in ("ddp", "fsdp") for p in (None, "full", "selective")]


def _body() -> list[int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    torch.manual_seed(0)
    return [measure(Net(), SHAPE, strategy=s, recompute=p) for s, p in CELLS]


@pytest.fixture(scope="module")
def measured() -> list[list[int]]:
    return cp.launch(_body, nprocs=2, timeout=300)


@pytest.mark.parametrize(("index", "cell"), list(enumerate(CELLS)), ids=str)
def test_every_rank_within_tolerance(
    measured: list[list[int]], index: int, cell: tuple[str, Any]
) -> None:
    strategy, policy = cell
    got = estimate_memory(
        _meta(), torch.empty(SHAPE, device="meta"), strategy=strategy, world_size=2,
        recompute=policy,
    )  # fmt: skip
    for rank, peaks in enumerate(measured):
        want = peaks[index]
        assert abs(got.peak - want) <= TOLERANCE * want, (rank, got, want)
