"""Two ranks over gloo: every rank's figures combined at the log interval, and only there."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

import cudakit as ck
from cudakit.speed import speed_report

pytestmark = pytest.mark.distributed


def _meter_two_ranks(peak_on_rank_1: bool) -> dict[str, Any]:
    with ck.process_group(timeout=30):
        rank = ck.rank()
        gathers = 0
        real = dist.all_gather

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal gathers
            gathers += 1
            return real(*args, **kwargs)

        dist.all_gather = counted  # type: ignore[assignment]
        lines: list[str] = []
        try:
            meter = speed_report(
                "ddp",
                samples=2 + rank,  # rank 0: 2 per call, rank 1: 3
                flops=1e6 * (1 + rank),
                peak_tflops=1.0 if rank == 0 or peak_on_rank_1 else None,
                accumulate=2,
                every=3,
                log=lines.append,
            )
            seen = []
            for _ in range(12):  # 6 optimizer steps: lines at steps 3 and 6
                with meter:
                    time.sleep(0.002 * (1 + 3 * rank))  # rank 1 is the slow one
                seen.append(gathers)
            local = meter.total
            combined = meter.combined
            assert combined is not None
            return {
                "gathers": seen,
                "lines": lines,
                "last_line": meter.last_line,
                "local": local.to_dict(),
                "recent": combined.recent.to_dict(),
                "total": combined.total.to_dict(),
            }
        finally:
            dist.all_gather = real  # type: ignore[assignment]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return ck.launch(_meter_two_ranks, True, nprocs=2, timeout=120)


def test_figures_are_combined_only_at_the_log_interval(two_ranks: list[dict[str, Any]]) -> None:
    for r in two_ranks:
        # One all_gather per line: at the 6th and 12th call (optimizer steps 3 and 6).
        assert r["gathers"] == [0] * 5 + [1] * 6 + [2]


def test_sums_over_ranks_and_the_slowest_time(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = two_ranks
    assert r0["total"] == r1["total"]  # every rank holds the same combined figures
    total = r0["total"]
    assert total["ranks"] == 2
    assert total["steps"] == 6
    assert total["calls"] == 24
    assert total["samples"] == 12 * 2 + 12 * 3
    assert total["flops"] == pytest.approx(12 * 1e6 + 12 * 2e6)
    assert total["seconds"] == max(r0["local"]["seconds"], r1["local"]["seconds"])
    assert total["seconds"] == r1["local"]["seconds"]  # rank 1 sleeps 4x longer
    assert total["peak_tflops"] == 2.0  # the ranks' peaks, summed
    assert total["mfu"] == pytest.approx(total["tflops"] / 2.0)
    assert r0["local"]["ranks"] == 1
    assert r0["local"]["samples"] == 24


def test_one_line_per_interval_from_rank_0(two_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = two_ranks
    assert len(r0["lines"]) == 2
    assert r1["lines"] == []
    assert r0["lines"][1].startswith("speed_report 'ddp' cpu x2 ranks step 6: ")
    assert r1["last_line"] == r0["lines"][1]  # every rank still holds it


def test_a_rank_without_a_peak_leaves_the_mfu_out() -> None:
    r0, _ = ck.launch(_meter_two_ranks, False, nprocs=2, timeout=120)
    recent = r0["recent"]
    assert recent["mfu"] is None
    assert recent["tflops"] is not None
    assert recent["mfu_reason"] == "rank(s) 1 have no peak; pass peak_tflops=... on every rank"
    assert "MFU n/a: rank(s) 1 have no peak" in r0["lines"][0]
    assert "MFU n/a" not in r0["lines"][-1]  # an advice is said once
