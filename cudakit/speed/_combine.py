"""Figures from every rank in one: sums of counts and FLOPs, the slowest rank's time.

One ``all_gather`` of a few numbers per rank, made only at the meter's log interval
(every rank reaches it at the same optimizer step), never per step. Each rank's peak
is gathered too, so the MFU is measured against the sum of the ranks' peaks, and a
rank without a peak leaves the combined MFU out, naming that rank.
"""

from __future__ import annotations

import math

import torch

from .._dist import group_world_size, is_group_running
from ._tally import Sums

__all__ = ["Combined", "combine", "group_ranks"]

_WIDTH = 6  # steps, calls, seconds, samples, tokens, flops


def group_ranks() -> int:
    """Ranks of the running default process group; 1 without one."""
    return group_world_size() if is_group_running() else 1


def _row(sums: Sums) -> list[float]:
    return [sums.steps, sums.calls, sums.seconds, sums.samples, sums.tokens, sums.flops]


def _merge(rows: list[list[float]]) -> Sums:
    return Sums(
        steps=int(max(r[0] for r in rows)),
        calls=int(sum(r[1] for r in rows)),
        seconds=max(r[2] for r in rows),  # the slowest rank sets the pace
        samples=sum(r[3] for r in rows),
        tokens=sum(r[4] for r in rows),
        flops=sum(r[5] for r in rows),
    )


class Combined:
    """The rolling window and the totals of every rank, and the ranks' summed peak."""

    def __init__(
        self, recent: Sums, total: Sums, ranks: int, peak: float | None, missing: list[int]
    ) -> None:
        self.recent = recent
        self.total = total
        self.ranks = ranks
        #: Sum of every rank's peak TFLOP/s, None when a rank has none.
        self.peak = peak
        #: Ranks that have no peak.
        self.missing = missing


def _device() -> torch.device:
    """Where the gather's tensor must live: the current GPU for NCCL, else the CPU."""
    backend = str(torch.distributed.get_backend())
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def combine(recent: Sums, total: Sums, peak: float | None) -> Combined:
    """Gather this rank's figures with every other rank's (a collective: call on all ranks)."""
    world = group_ranks()
    if world == 1:
        return Combined(recent, total, 1, peak, [] if peak is not None else [0])
    row = [*_row(recent), *_row(total), math.nan if peak is None else peak]
    local = torch.tensor(row, dtype=torch.float64, device=_device())
    gathered = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    rows = [t.tolist() for t in gathered]
    peaks = [r[-1] for r in rows]
    missing = [i for i, p in enumerate(peaks) if math.isnan(p)]
    return Combined(
        _merge([r[:_WIDTH] for r in rows]),
        _merge([r[_WIDTH : 2 * _WIDTH] for r in rows]),
        world,
        None if missing else sum(peaks),
        missing,
    )
